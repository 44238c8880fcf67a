"""Multi-token prediction (issue 61 item 3, `mtp.py`): the depths' logits are DeepSeek-V3's equations written out
by hand (fp32), packed documents included; the loss is the main loss plus the weighted MTP loss, whose gradient
reaches the trunk; the depths stay off in evaluation and decoding; bad settings are one line."""

from __future__ import annotations

import pytest
import torch
from test_deepseek_v3 import MLA_BLOCK

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.loss import IGNORE_INDEX, cross_entropy
from mtnlg_lightning.model import KVCache, Rotary, build_model
from mtnlg_lightning.mtp import MultiTokenPredictionLoss
from mtnlg_lightning.parallel.layout import ParallelLayout
from mtnlg_lightning.parallel.output_layer import OutputLoss, heads_in_loss
from mtnlg_lightning.parallel.parallelize import _check_multi_token_prediction
from mtnlg_lightning.train.extensions import extensions_for
from mtnlg_lightning.train.extensions.mixture_of_experts import RouterBalancing
from mtnlg_lightning.train.extensions.multi_token_prediction import MultiTokenPredictionLosses

DEPTHS = 2
LENGTHS = (9, 11)  # two packed documents


def mtp_model(**overrides):
    config = get_config("tiny-llama", **{**MLA_BLOCK, "mtp_layers": DEPTHS, "mtp_loss_weight": 0.3, **overrides})
    torch.manual_seed(0)
    model = build_model(config)
    with torch.no_grad():  # norms away from 1: a norm applied in the wrong place changes the logits
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("ln1.weight", "ln2.weight")):
                param.uniform_(0.5, 1.5)
    return model


def packed_row():
    tokens = torch.randint(0, 4096, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(LENGTHS)])[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = torch.cat([torch.cat([t[1:], t.new_tensor([IGNORE_INDEX])]) for t in tokens[0].split(LENGTHS)])[None]
    return tokens, documents, positions, labels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_depth_logits(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """DeepSeek-V3's MTP for one document alone [1, n]: h_0 the main model's normed final hidden states,
    h_k = norm_k(Block_k(eh_proj([enorm(Emb(t_{i+k})); hnorm(h_{k-1})]))), logits_k = head(h_k); position i of
    depth k valid for i + k < n (the rest are dropped here)."""
    eps, n = model.config.layernorm_eps, tokens.shape[1]
    GPT = type(model)
    GPT.head_in_loss = True
    try:
        previous = model(tokens)
    finally:
        GPT.head_in_loss = False
    logits = []
    for k, layer in enumerate(model.mtp.layers.values(), start=1):
        ahead = torch.cat([tokens[:, k:], tokens[:, :k]], dim=1)  # token i + k at i; the tail never counts
        embedded = model.embed.wte.weight[ahead]
        joined = torch.cat(
            [rms_norm(embedded, layer.enorm.weight, eps), rms_norm(previous, layer.hnorm.weight, eps)], dim=-1
        )
        h = joined @ layer.eh_proj.weight.T
        h = layer.block(h, Rotary(model, 0))
        previous = rms_norm(h, layer.norm.weight, eps)
        logits.append((previous @ model.lm_head.weight.T)[:, : n - k])
    return logits


def test_the_depths_logits_are_deepseek_v3_s_equations_by_hand_in_each_packed_document():
    model = mtp_model().train()  # training runs the depths (no dropout in this config)
    tokens, documents, positions, _ = packed_row()
    with torch.no_grad():
        model(tokens, position_ids=positions, document_ids=documents)
        outputs = model.mtp.take()
        model.eval()  # the reference's own trunk forward: no depth
        apart = [reference_depth_logits(model, piece) for piece in tokens.split(LENGTHS, dim=1)]
    assert len(outputs) == DEPTHS and model.mtp.take() is None  # taken once
    for k, (logits, counted) in enumerate(outputs, start=1):
        starts = [0, LENGTHS[0]]
        expected_counted = torch.zeros(sum(LENGTHS), dtype=torch.bool)
        for start, n in zip(starts, LENGTHS, strict=True):
            expected_counted[start : start + n - k] = True
        assert torch.equal(counted[0], expected_counted)  # nothing across the documents' boundary or the row's end
        reference = torch.cat([per_document[k - 1] for per_document in apart], dim=1)
        torch.testing.assert_close(logits[:, counted[0]], reference, rtol=1e-5, atol=1e-5)


def test_the_loss_is_the_main_loss_plus_the_weighted_mtp_loss_and_reaches_the_trunk():
    model = mtp_model().train()
    tokens, documents, positions, labels = packed_row()

    class Holder:
        pass

    holder = Holder()
    holder.model = model
    loss_fn = MultiTokenPredictionLoss(OutputLoss(model, 4096), holder, model.config)
    with heads_in_loss(model):
        hidden = model(tokens, position_ids=positions, document_ids=documents)
    total = loss_fn(hidden, labels)
    # by hand: the main cross-entropy and each depth's over the labels k further, within each document
    logits = model.lm_head(hidden)
    main = cross_entropy(logits, labels)
    depth_losses = []
    with torch.no_grad():
        model(tokens, position_ids=positions, document_ids=documents)  # the depths' logits (head not in the loss)
    for k, (depth_logits, _) in enumerate(model.mtp.take(), start=1):
        ahead = torch.full_like(labels, IGNORE_INDEX)
        for start, n in zip((0, LENGTHS[0]), LENGTHS, strict=True):
            ahead[:, start : start + n - k] = labels[:, start + k : start + n]
        depth_losses.append(cross_entropy(depth_logits, ahead))
    expected = main + 0.3 / DEPTHS * sum(depth_losses)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    assert set(loss_fn.last) == {"mtp_loss", "main_loss"}
    torch.testing.assert_close(loss_fn.last["mtp_loss"], sum(depth_losses) / DEPTHS, rtol=1e-5, atol=1e-6)
    # the MTP loss's gradient reaches the trunk (a block's weight and the shared embedding) and every depth
    total.backward()
    trunk = dict(model.blocks["0"].named_parameters())
    trunk_with = {name: param.grad.clone() for name, param in trunk.items()}
    for name, param in model.mtp.named_parameters():
        if "experts" not in name and "router" not in name and "expert_bias" not in name:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
    model.zero_grad()
    with heads_in_loss(model):
        hidden = model(tokens, position_ids=positions, document_ids=documents)
    model.mtp.take()
    OutputLoss(model, 4096)(hidden, labels).backward()
    assert all(not torch.allclose(trunk_with[name], param.grad) for name, param in trunk.items())


def test_evaluation_and_decoding_run_no_depth_unless_asked():
    model = mtp_model().eval()
    tokens, _, _, _ = packed_row()
    with torch.no_grad():
        model(tokens)
        assert model.mtp.outputs is None
        cache = KVCache(tokens.shape[1] + 1)
        model.train()
        model(tokens, cache=cache)
        assert model.mtp.outputs is None
        model.eval()
        model.predict_ahead = True
        model(tokens)
    assert len(model.mtp.take()) == DEPTHS


def test_the_extension_wraps_the_loss_before_the_router_losses():
    config = mtp_model().config
    kinds = [type(extension) for extension in extensions_for(config, {})]
    assert kinds == [MultiTokenPredictionLosses, RouterBalancing]
    assert extensions_for(get_config("tiny-llama", **MLA_BLOCK), {})[0].__class__ is RouterBalancing
    with pytest.raises(MTNLGError, match="trains with the lm objective, not 'dpo': set model.mtp_layers to 0"):
        extensions_for(config, {"objective": "dpo"})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mtp_layers": -1}, "mtp_layers must be an integer >= 0"),
        ({"mtp_loss_weight": -0.1}, "mtp_loss_weight must be a number >= 0"),
    ],
)
def test_bad_mtp_settings_are_one_line(change, message):
    with pytest.raises(MTNLGError, match=message):
        get_config("tiny-llama", **{**MLA_BLOCK, **change})


def test_every_layout_takes_the_depths_but_a_position_table_under_context_parallelism():
    config = mtp_model().config
    _check_multi_token_prediction(config, ParallelLayout(8, tensor_parallel=2, pipeline_parallel=2, context_parallel=2))
    learned = get_config("tiny", mtp_layers=1)  # a position table: the chunks' tokens ahead are not placed by it
    with pytest.raises(MTNLGError, match="under context parallelism needs rotary positions"):
        _check_multi_token_prediction(learned, ParallelLayout(2, context_parallel=2))
    _check_multi_token_prediction(learned, ParallelLayout(2, tensor_parallel=2))


def test_the_depths_rolled_labels_ignore_the_row_end():
    from mtnlg_lightning.mtp import counted_ahead, labels_ahead

    labels = torch.arange(6)[None]
    counted = counted_ahead((1, 6), 2, None, labels.device)
    assert labels_ahead(labels, 2, counted).tolist() == [[2, 3, 4, 5, IGNORE_INDEX, IGNORE_INDEX]]


def test_the_training_module_s_loss_adds_the_weighted_mtp_loss_and_keeps_both_for_the_logs():
    from mtnlg_lightning.train.module import MTNLGModule

    overrides = {**MLA_BLOCK, "mtp_layers": 1, "mtp_loss_weight": 0.5, "router_aux_loss_coef": 0.01}
    module = MTNLGModule(preset="tiny-llama", model_overrides=overrides)
    module.configure_model()
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(3))
    module.model.train()
    with torch.no_grad(), heads_in_loss(module.model):
        total = module.loss_fn(module.model(tokens[:, :-1]), tokens[:, 1:])
    mtp_losses = module.extensions[0].losses
    main, mtp = mtp_losses.last["main_loss"], mtp_losses.last["mtp_loss"]
    router = module.loss_fn.aux_coef * module.loss_fn.last["router_aux_loss"]  # the MoE wrapper is the outer one
    torch.testing.assert_close(total, main + 0.5 * mtp + router, rtol=1e-6, atol=0)
    assert mtp > 0 and mtp != main
    assert set(mtp_losses.step_means()) == {"main_loss", "mtp_loss"}


# ------------------------------------------------------------------------------------ DeepSeek-V3 checkpoints
@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    from deepseek_models import add_mtp_layers, random_deepseek_dir

    return add_mtp_layers(random_deepseek_dir(tmp_path_factory.mktemp("mtp"), "deepseek_v3"))


def test_a_checkpoint_s_mtp_layer_gives_transformers_mtp_logits_when_asked(mtp_dir):
    """init_from with mtp_layers 1 reads layer num_hidden_layers into the depth: its logits are those of
    transformers' MtpModel (speculative decoding's, loaded from the same files) to 1e-5 (fp32)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_layers import MtpModel

    from mtnlg_lightning.interop.init_from import config_for_init, load_init_weights

    main = transformers.AutoModelForCausalLM.from_pretrained(mtp_dir, dtype=torch.float32).eval()
    # transformers finds MTP layers by the main model's ignore pattern, written for the 61-layer model
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3.*"]
    theirs_mtp = MtpModel.from_pretrained(main).eval()
    tokens = torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        last = main(tokens, output_hidden_states=True).hidden_states[-1]  # after the final norm
        h = theirs_mtp.forward_layer(0, last[:, :-1], torch.arange(1, 16)[None], None, input_ids=tokens[:, 1:])
        theirs = theirs_mtp._project_to_logits(h)
    config = config_for_init(str(mtp_dir), "tiny", {"mtp_layers": 1})
    model = build_model(config).train()
    load_init_weights(model, str(mtp_dir))
    with torch.no_grad():
        model(tokens)
    ((logits, counted),) = model.mtp.take()
    assert counted[0].tolist() == [True] * 15 + [False]
    torch.testing.assert_close(logits[:, :-1, :4096], theirs, rtol=1e-5, atol=1e-5)


def test_mtp_layers_0_drops_the_checkpoint_s_and_another_count_is_one_line(mtp_dir):
    from mtnlg_lightning.interop.hf import read_source
    from mtnlg_lightning.interop.init_from import config_for_init, load_init_weights

    dropped = build_model(config_for_init(str(mtp_dir), "tiny", {}))
    load_init_weights(dropped, str(mtp_dir))  # the default: no depth, the layer left unread
    assert dropped.mtp is None
    with pytest.raises(MTNLGError, match=r"holds 1 multi-token prediction layer.*asks for 2: set mtp_layers to 1"):
        read_source(mtp_dir, mtp_layers=2)


def test_the_export_writes_the_mtp_layer_back_and_transformers_loads_the_same_model(mtp_dir, tmp_path):
    import json

    transformers = pytest.importorskip("transformers")
    from mtnlg_lightning.checkpoint.safetensors_shards import ShardedTensors
    from mtnlg_lightning.interop.hf import export_hf, read_source

    export_hf(read_source(mtp_dir, mtp_layers=1), tmp_path / "exported")
    exported, source = ShardedTensors(tmp_path / "exported"), ShardedTensors(mtp_dir)
    assert sorted(exported.names) == sorted(source.names)  # layer 3 whole, its embedding and head copies included
    for name in source.names:
        assert torch.equal(exported.read(name), source.read(name)), name
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    tokens = torch.randint(0, 4096, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = [
            transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(tokens).logits
            for path in (mtp_dir, tmp_path / "exported")
        ]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ layouts
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_tensor_parallel_depths_give_the_single_process_loss_and_gradients(sequence_parallel):
    """Threads as ranks: the depths' blocks sharded as the trunk's (MLA's heads, the shared experts), eh_proj and
    the depths' norms whole (under SP on each rank's sequence slice, their gradients summed), the head
    vocabulary-parallel inside the loss: the main + MTP loss and every gradient are one process's (the weights
    fp64, the cross-entropy fp32 as ever)."""
    import copy

    import torch.distributed as dist
    from threaded_group import run_ranks

    from mtnlg_lightning.moe import moe_layers
    from mtnlg_lightning.parallel.tensor_parallel import apply_tensor_parallel, gather_tensor_parallel

    class Holder:
        def __init__(self, model):
            self.model = model

    reference = mtp_model().double().train()
    tokens, documents, positions, labels = packed_row()
    inputs = {"position_ids": positions, "document_ids": documents}
    loss_fn = MultiTokenPredictionLoss(cross_entropy, Holder(reference), reference.config)
    loss = loss_fn(reference(tokens, **inputs), labels)
    loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    for _, layer in moe_layers(reference):
        layer.stats = None  # the last forward's (differentiable) statistics: not copied to the ranks

    def rank_fn(rank: int, size: int = 2):
        group = dist.group.WORLD
        model = apply_tensor_parallel(copy.deepcopy(reference), group, rank, size, sequence_parallel)
        vocab_local = model.config.padded_vocab_size() // size
        loss_fn = MultiTokenPredictionLoss(OutputLoss(model, vocab_local, group), Holder(model), model.config)
        with heads_in_loss(model):
            loss = loss_fn(model(tokens, **inputs), labels)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            sharded = hasattr(p, "partition_dim") and p.partition_count > 1
            grads[name] = gather_tensor_parallel(p.grad, p.partition_dim, group) if sharded else p.grad
        return loss.detach(), grads

    for rank_loss, grads in run_ranks(2, rank_fn):
        assert rank_loss.item() == pytest.approx(loss.item(), rel=1e-6)
        assert grads.keys() == expected.keys() and any(name.startswith("mtp.") for name in grads)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_last_pipeline_stage_holds_the_depths_with_a_copy_of_the_embedding(tied):
    """The depths live on the last stage only; their embedding is a plain tensor there (the per-step copy of the
    first stage's: the tied head's own copy where the head is tied), no parameter of its own. One rank holding both
    ends (V-shaped schedules): the embedding itself."""
    import copy

    from mtnlg_lightning.parallel.pipeline import split_into_stages

    model = mtp_model(tie_embeddings=tied, num_layers=4)
    first, last = (split_into_stages(copy.deepcopy(model), 2, rank, "1f1b", 1)[0][0] for rank in (0, 1))
    assert first.mtp is None and last.embed is None
    weight = last.mtp.embed.wte.weight
    assert not isinstance(weight, torch.nn.Parameter) and torch.equal(weight, model.embed.wte.weight)
    assert (weight is last.lm_head.weight) == tied
    assert not any(name.startswith("mtp.embed") for name, _ in last.named_parameters())
    first, *_, last = split_into_stages(model, 2, 0, "zbv_zero_bubble", 2)[0]
    assert last.mtp.embed is first.embed


def test_the_planner_counts_the_depths_apart_on_the_last_stage_and_their_compute():
    import dataclasses

    from mtnlg_lightning.families import count_parameters, expert_parameters_per_layer, mtp_parameters
    from mtnlg_lightning.planning.planner import expert_params_per_stage, params_per_stage
    from mtnlg_lightning.train.flops import forward_flops_per_token

    for tied in (True, False):
        config = mtp_model(tie_embeddings=tied).config
        trunk = dataclasses.replace(config, mtp_layers=0)
        model = build_model(config, "meta")
        depths = sum(p.numel() for name, p in model.named_parameters() if name.startswith("mtp."))
        assert count_parameters(config) == sum(p.numel() for p in model.parameters())
        assert mtp_parameters(config) == depths > 0
        assert count_parameters(trunk) == count_parameters(config) - depths
        layers = [1, config.num_layers - 1]
        with_depths, without = params_per_stage(config, 1, 2, layers), params_per_stage(trunk, 1, 2, layers)
        copy = 0 if tied else config.padded_vocab_size() * config.hidden_size  # the last stage's embedding copy
        assert with_depths[0] == without[0] and with_depths[1] == without[1] + depths + copy
        experts = expert_parameters_per_layer(config)[-1]
        assert expert_params_per_stage(config, layers, 2)[1] == expert_params_per_stage(trunk, layers, 2)[1] + (
            DEPTHS * experts // 2
        )
        assert mtp_parameters(config, 1, 2) == depths - DEPTHS * (experts - experts // 2)
    # each depth costs a block's, eh_proj's and the head's FLOPs: between a block's and the whole trunk's
    extra = forward_flops_per_token(config) - forward_flops_per_token(trunk)
    head = 2 * config.hidden_size * config.padded_vocab_size()
    assert DEPTHS * head < extra < DEPTHS * forward_flops_per_token(trunk)


def test_mtnlg_plan_reports_deepseek_v3_s_depth_apart_and_counts_it_on_the_last_stage(capsys):
    """DeepSeek-V3 trained with its one MTP layer: 11.6 B parameters apart (a MoE block, eh_proj, three norms; the
    checkpoint's copies of the embedding and head are not parameters here), on the last of 16 stages."""
    import json

    from mtnlg_lightning.planning.plan_cli import main as plan_main

    layout = ["--model", "deepseek-v3", "--tp", "1", "--pp", "16", "--dp", "1", "--recompute", "full", "--json"]
    plans = []
    for depths in ([], ["--mtp-layers", "1"]):
        capsys.readouterr()
        assert plan_main([*layout, *depths]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    without, with_depth = plans
    assert without["mtp_params"] == 0 and round(with_depth["mtp_params"] / 1e8) == 116
    assert with_depth["params_per_gpu"] == without["params_per_gpu"] + with_depth["mtp_params"] + 129280 * 7168
    assert with_depth["flops_per_iteration"] > without["flops_per_iteration"]


def test_the_depths_routers_count_in_the_router_statistics_and_their_bias_balances():
    """A depth's MoE block routes as a layer of the model (Megatron's): its assignments join the router statistics
    under its own name, its sigmoid router's bias moves toward balance; a forward without the depths (evaluation)
    keeps no statistics of theirs."""
    from mtnlg_lightning.moe import RouterTotals, balance_expert_bias, moe_layers

    model = mtp_model().train()
    totals = RouterTotals(model.config)
    assert totals.layer_names == ["blocks.1.mlp", "mtp.layers.0.block.mlp", "mtp.layers.1.block.mlp"]
    tokens, documents, positions, _ = packed_row()
    with torch.no_grad():
        model(tokens, position_ids=positions, document_ids=documents)
    counted = totals.expert_tokens(totals.of(model, tokens.device))
    k = model.config.experts_per_token
    assert all(counted[name].sum() == k * tokens.numel() for name in totals.layer_names)
    step_tokens = torch.stack([counted[name] for name in totals.layer_names])
    balance_expert_bias(model, step_tokens, totals.layer_names, 0.5)
    depth_router = dict(moe_layers(model))["mtp.layers.0.block.mlp"]
    assert depth_router.expert_bias.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        model(tokens)
    assert depth_router.stats is None and dict(moe_layers(model))["blocks.1.mlp"].stats is not None


def test_a_trained_model_s_depths_export_and_read_back_as_they_were(mtp_dir, tmp_path):
    """What a checkpoint of a run with mtp_layers 1 holds (the model's own weights, the depth changed by training)
    exports with num_nextn_predict_layers 1 and reads back, depth and all, as it was."""
    from mtnlg_lightning.checkpoint import ModelState
    from mtnlg_lightning.interop.hf import export_hf, read_source
    from mtnlg_lightning.interop.init_from import config_for_init, load_init_weights
    from mtnlg_lightning.model import persistent_buffers

    config = config_for_init(str(mtp_dir), "tiny", {"mtp_layers": 1})
    model = build_model(config)
    load_init_weights(model, str(mtp_dir))
    with torch.no_grad():
        model.mtp.layers["0"].eh_proj.weight.add_(0.1)  # "trained"
        model.mtp.layers["0"].block.mlp.expert_bias.add_(0.01)
    weights = {**dict(model.named_parameters()), **dict(persistent_buffers(model))}
    weights["embed.wte.weight"] = weights["embed.wte.weight"][: config.vocab_size]
    weights["lm_head.weight"] = weights["lm_head.weight"][: config.vocab_size]
    export_hf(ModelState(config, {k: v.detach() for k, v in weights.items()}, {}), tmp_path / "exported")
    back = read_source(tmp_path / "exported", mtp_layers=1).weights
    for name in (n for n in weights if n.startswith("mtp.")):
        assert torch.equal(back[name], weights[name].detach()), name
