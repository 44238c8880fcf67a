"""Mixture of experts is options of the one model (`moe.py`), proven against transformers: random Qwen 3-MoE (a
dense layer among MoE ones, the top k renormalised), Qwen 2-MoE (a shared expert), Mixtral and OLMoE directories
with per-expert keys give transformers' logits and greedy text; the grouped GEMM and the per-expert loop give the
same numbers; the router losses are transformers' load-balancing loss and ST-MoE's z-loss; the presets count
transformers' parameters; the planner reports the active ones; bad input is one line."""

from __future__ import annotations

import json
import shutil

import pytest
import test_model_families as dense_families
import torch
import torch.nn.functional as F
from hf_models import RANDOM_MOE, random_moe_dir

from mtnlg_lightning import moe
from mtnlg_lightning.checkpoint.safetensors_shards import ShardedTensors
from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import active_parameters, count_parameters, family_of
from mtnlg_lightning.inference.generate_cli import main as generate_main
from mtnlg_lightning.inference.load import load_model
from mtnlg_lightning.interop import llama_mapping
from mtnlg_lightning.interop.hf import mapping_for
from mtnlg_lightning.model import build_model, persistent_buffers
from mtnlg_lightning.parallel.output_layer import heads_in_loss
from mtnlg_lightning.planning.plan_cli import main as plan_main

transformers = pytest.importorskip("transformers")
MOE_PRESETS = ["qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "mixtral-8x22b", "olmoe-1b-7b"]
# Published totals and active counts (model cards: Qwen3-30B-A3B "30.5B, 3.3B activated", Mixtral 8x7B 46.7B and
# 12.9B active, OLMoE "1B active, 7B total"), as transformers counts them.
PUBLISHED = {"qwen3-30b-a3b": 30_532_122_624, "mixtral-8x7b": 46_702_792_704}


def tiny_moe(**overrides):
    """The Llama block with experts and a shared expert: a custom block (Qwen 2-MoE's has q/k/v biases)."""
    values = dict(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=32, shared_expert_ffn_hidden_size=48)
    return get_config("tiny-llama", **{"family": None, **values, **overrides})


@pytest.fixture(scope="module", params=sorted(RANDOM_MOE))
def family_dir(request, tmp_path_factory):
    """A random directory of each MoE family (the dense families' specifications in test_model_families.py run on
    these too)."""
    return random_moe_dir(tmp_path_factory.mktemp(request.param), request.param)


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


# ------------------------------------------------------------------------------------------- transformers
def test_each_directory_reads_as_its_family_with_its_moe_layers(family_dir):
    config = load_model(family_dir)[0].config
    family = json.loads((family_dir / "config.json").read_text())["model_type"]
    assert family_of(config).hf_model_type == family and config.num_experts == 4 and config.experts_per_token == 2
    if family == "qwen3_moe":
        assert config.moe_layers == (0, 2) and config.norm_topk_prob  # layer 1 dense, as listed
    if family == "qwen2_moe":
        assert config.shared_expert_ffn_hidden_size == 48
    if family == "olmoe":
        assert config.qk_norm_over == "projection"


def test_our_logits_equal_transformers(family_dir):
    dense_families.test_our_logits_equal_transformers(family_dir)


def test_greedy_generation_prints_transformers_continuation(family_dir, capsys):
    capsys.readouterr()  # transformers' progress bars
    dense_families.test_greedy_generation_prints_transformers_continuation(family_dir, capsys)


def test_export_writes_per_expert_keys_transformers_loads_with_our_logits(family_dir, tmp_path):
    dense_families.test_export_writes_the_family_transformers_loads_with_our_logits(family_dir, tmp_path)
    exported = ShardedTensors(tmp_path / "exported")
    source = ShardedTensors(family_dir)
    assert sorted(exported.names) == sorted(source.names)  # one tensor per expert, as shipped
    for name in source.names:
        assert torch.equal(exported.read(name), source.read(name)), name


def test_a_sharded_directory_reads_as_the_single_file(family_dir, tmp_path):
    sharded = tmp_path / "sharded"
    hf_model(family_dir).save_pretrained(sharded, max_shard_size="100KB")
    shutil.copy(family_dir / "tokenizer.json", sharded)
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    tokens = torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(2))
    (one, _), (many, _) = load_model(family_dir), load_model(sharded)
    with torch.no_grad():
        assert torch.equal(one(tokens), many(tokens))


def test_the_router_losses_are_transformers_load_balancing_loss_and_the_z_loss():
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    config = tiny_moe(num_layers=3, dense_layers=[1])
    torch.manual_seed(0)
    model = build_model(config)
    logits = []
    for _, layer in moe.moe_layers(model):
        layer.router.register_forward_hook(lambda module, args, out: logits.append(out))
    model(torch.randint(0, 4096, (2, 24)))
    aux, z = moe.router_losses(model)
    assert len(logits) == 2
    expected = load_balancing_loss_func(tuple(logits), config.num_experts, config.experts_per_token)
    torch.testing.assert_close(aux, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(z, torch.logsumexp(torch.cat(logits), dim=-1).square().mean(), rtol=1e-6, atol=0)
    aux.backward()  # differentiable through the routing probabilities
    assert all(layer.router.weight.grad.abs().sum() > 0 for _, layer in moe.moe_layers(model))


# ------------------------------------------------------------------------------------------- the layer
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_gemm_and_the_per_expert_loop_give_the_same_numbers(dtype, monkeypatch):
    config = tiny_moe(moe_ffn_hidden_size=64)
    torch.manual_seed(0)
    layer = build_model(config).blocks["1"].mlp.to(dtype)
    x = torch.randn(2, 40, config.hidden_size, dtype=dtype)
    results = {}
    for kernel in ("grouped_mm", "loop"):
        monkeypatch.setattr(moe.Experts, "kernel", kernel)
        layer.zero_grad()
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out.backward(torch.ones_like(out))
        results[kernel] = [out, inputs.grad, *(p.grad for p in layer.parameters())]
    for grouped, loop in zip(results["grouped_mm"], results["loop"], strict=True):
        torch.testing.assert_close(grouped, loop, rtol=0 if dtype == torch.float32 else 1e-2, atol=0)


def test_experts_widths_the_grouped_gemm_cannot_run_fall_back_to_the_loop(monkeypatch):
    layer = build_model(tiny_moe(moe_ffn_hidden_size=30)).blocks["0"].mlp  # 30 fp32 values: not 16-byte rows
    x = torch.randn(1, 8, 64)
    assert not layer.experts._grouped(x)
    monkeypatch.setattr(moe.Experts, "kernel", "grouped_mm")
    with pytest.raises(MTNLGError, match="cannot run"):
        layer(x)


def test_a_capacity_factor_drops_and_counts_the_overflow_and_a_large_one_is_dropless():
    torch.manual_seed(0)
    config = tiny_moe(shared_expert_ffn_hidden_size=0)
    dropless = build_model(config).blocks["0"].mlp
    x = torch.randn(1, 64, config.hidden_size)
    expected = dropless(x)
    counts = dropless.stats.tokens_per_expert
    for factor, dropped in ((4.0, 0), (0.5, int((counts - 16).clamp(min=0).sum()))):  # 64 x 2 / 4 x 0.5 = 16
        capped = moe.MoE(dataclass_replace(config, capacity_factor=factor))
        capped.load_state_dict(dropless.state_dict())
        out = capped(x)
        assert capped.stats.dropped == dropped
        if dropped:
            assert dropped > 0 and not torch.allclose(out, expected)
        else:
            torch.testing.assert_close(out, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- sigmoid router
def test_the_sigmoid_router_chooses_by_score_plus_bias_and_weighs_by_the_score_alone():
    """DeepSeek-V3's routing: each expert's sigmoid score; the bias only decides which k experts a token goes to,
    the weights are the chosen scores (renormalised with norm_topk_prob)."""
    torch.manual_seed(0)
    layer = moe.MoE(tiny_moe(router="sigmoid", shared_expert_ffn_hidden_size=0, norm_topk_prob=True))
    torch.nn.init.normal_(layer.router.weight, std=0.5)
    x = torch.randn(32, layer.router.weight.shape[1])
    scores = torch.sigmoid(layer.router(x))
    assert layer.expert_bias.dtype == torch.float32 and not layer.expert_bias.any()  # balanced: no bias yet
    weights, chosen = layer.route(x)
    torch.testing.assert_close(chosen, scores.topk(2).indices, rtol=0, atol=0)
    layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 2.0]))  # expert 3 wins every token's first place
    weights, chosen = layer.route(x)
    assert (chosen[:, 0] == 3).all()
    picked = scores.gather(-1, chosen)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))  # the bias never weighs
    assert torch.equal(layer.stats.tokens_per_expert, torch.bincount(chosen.flatten(), minlength=4).float())


def test_the_sigmoid_router_routes_and_its_layer_computes_as_transformers_deepseek_v3_does():
    """transformers' DeepSeek-V3 router (one expert group, routed_scaling_factor 1, norm_topk_prob) and its experts,
    holding our router's weight, our bias after balancing steps and our stacked experts: the same experts chosen,
    the same weights and the same layer output (no shared expert)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts, DeepseekV3TopkRouter

    torch.manual_seed(0)
    config = tiny_moe(router="sigmoid", shared_expert_ffn_hidden_size=0, norm_topk_prob=True)
    model = build_model(config)
    layer = model.blocks["0"].mlp
    torch.nn.init.normal_(layer.router.weight, std=0.3)
    x = torch.randn(1, 64, config.hidden_size)
    unbiased = layer.route(x[0])[1]
    for _ in range(4):  # the bias our rule makes of this layer's loads
        layer(x)
        loads = torch.stack([layer.stats.tokens_per_expert, torch.zeros(4)])  # block 1 balanced: left as it is
        moe.balance_expert_bias(model, loads, moe.routed_layer_names(config), 0.05)
    assert layer.expert_bias.abs().sum() > 0
    theirs_config = transformers.DeepseekV3Config(
        hidden_size=config.hidden_size, moe_intermediate_size=config.moe_ffn_hidden_size, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
    )  # fmt: skip
    router, experts = DeepseekV3TopkRouter(theirs_config), DeepseekV3Experts(theirs_config)
    with torch.no_grad():
        router.weight.copy_(layer.router.weight)
        router.e_score_correction_bias.copy_(layer.expert_bias)
        experts.gate_up_proj.copy_(torch.cat([layer.experts.gate.weight, layer.experts.up.weight], dim=1))
        experts.down_proj.copy_(layer.experts.down.weight)
    _, their_weights, their_chosen = router(x)
    our_weights, our_chosen = layer.route(x[0])
    assert not torch.equal(our_chosen.sort(-1).values, unbiased.sort(-1).values)  # the bias moved some tokens
    order, their_order = our_chosen.argsort(-1), their_chosen.argsort(-1)  # theirs come unsorted
    assert torch.equal(our_chosen.gather(-1, order), their_chosen.gather(-1, their_order))
    torch.testing.assert_close(our_weights.gather(-1, order), their_weights.gather(-1, their_order))
    torch.testing.assert_close(layer(x)[0], experts(x[0], their_chosen, their_weights), rtol=1e-5, atol=1e-6)


def test_the_expert_bias_steps_toward_balance_after_a_step_and_stays_fp32_through_a_cast():
    """Megatron's and DeepSeek-V3's update: + rate for an expert under the mean load, - rate over it, 0 at it."""
    model = build_model(tiny_moe(router="sigmoid", shared_expert_ffn_hidden_size=0, num_layers=2))
    step_tokens = torch.tensor([[10.0, 30.0, 20.0, 20.0], [0.0, 0.0, 0.0, 80.0]])  # per MoE layer, per expert
    moe.balance_expert_bias(model, step_tokens, moe.routed_layer_names(model.config), 0.25)
    moe.balance_expert_bias(model, step_tokens, moe.routed_layer_names(model.config), 0.25)
    assert model.blocks["0"].mlp.expert_bias.tolist() == [0.5, -0.5, 0.0, 0.0]
    assert model.blocks["1"].mlp.expert_bias.tolist() == [0.5, 0.5, 0.5, -0.5]
    model.blocks["0"].mlp.expert_bias.fill_(1 + 2**-20)  # bf16 would round it to 1
    model.to(torch.bfloat16)
    bias = model.blocks["0"].mlp.expert_bias
    assert bias.dtype == torch.float32 and bias[0].item() == 1 + 2**-20
    assert model.blocks["0"].mlp.router.weight.dtype == torch.bfloat16
    assert [name for name, _ in persistent_buffers(model)] == ["blocks.0.mlp.expert_bias", "blocks.1.mlp.expert_bias"]


def test_a_sigmoid_router_model_is_refused_by_the_export_in_one_line():
    """No Hugging Face family this export writes routes by sigmoid with a bias (DeepSeek-V3's does, with latent
    attention this trainer lacks): a family refuses it, and the custom block has no Hugging Face form."""
    assert family_of(get_config("qwen3-30b-a3b")).hf_model_type == "qwen3_moe"
    with pytest.raises(MTNLGError, match="^model option router='sigmoid' .* contradicts family qwen3_moe"):
        get_config("qwen3-30b-a3b", router="sigmoid")
    config = get_config("qwen3-30b-a3b", family=None, router="sigmoid")
    with pytest.raises(MTNLGError, match="^a Hugging Face export needs a model family, and this model names none"):
        mapping_for(config)


def dataclass_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def test_a_config_without_experts_builds_the_dense_block():
    """No MoE option set: no router or expert in the model (the stored-loss test of test_labels.py shows its
    numbers unchanged)."""
    names = [name for name, _ in build_model(get_config("tiny-llama"), "meta").named_parameters()]
    assert names and not any("router" in n or "experts" in n or "shared" in n for n in names)
    config = tiny_moe(num_experts=0, family="llama")
    assert not config.moe and config.moe_layers == () and family_of(config).name == "llama"


def test_which_layers_are_moe_follows_qwen_and_deepseek_rules():
    config = tiny_moe(num_layers=8, moe_layer_step=2, dense_layers=[5], first_dense_layers=2)
    assert config.moe_layers == (3, 7)  # (i + 1) % 2 == 0, not 5, not below 2
    model = build_model(config, "meta")
    assert {i for i, block in model.blocks.items() if isinstance(block.mlp, moe.MoE)} == {"3", "7"}
    assert count_parameters(config) == sum(p.numel() for p in model.parameters())


def test_loss_and_gradients_flow_to_every_expert_that_was_routed():
    torch.manual_seed(0)
    model = build_model(tiny_moe())
    tokens = torch.randint(0, 4096, (4, 33))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    for _, layer in moe.moe_layers(model):
        used = layer.stats.tokens_per_expert > 0
        grads = layer.experts.gate.weight.grad.flatten(1).abs().sum(1)
        assert torch.equal(grads > 0, used)


# ------------------------------------------------------------------------------------------- counts
@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_moe_presets_count_transformers_parameters(preset):
    config = get_config(preset)
    family = family_of(config)
    assert family is not None and family.hf_model_type in llama_mapping.MOE_TYPES
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(
            llama_mapping.hf_config(transformers, config, config.vocab_size, None, "float32")
        )
    assert type(theirs).__name__ == family.hf_architecture
    assert (
        count_parameters(config)
        == sum(p.numel() for p in theirs.parameters())
        == PUBLISHED.get(preset, count_parameters(config))
    )
    experts = sum(p.numel() for n, p in theirs.named_parameters() if ".experts." in n)
    share = config.experts_per_token / config.num_experts
    assert active_parameters(config) == count_parameters(config) - round(experts * (1 - share))


def test_the_planner_reports_total_and_active_parameters_of_the_moe_presets(capsys):
    for preset in MOE_PRESETS:
        assert plan_main(["--model", preset, "--tp", "1", "--pp", "1", "--dp", "1", "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        config = get_config(preset)
        assert plan["params_per_gpu"] == count_parameters(config), preset
        assert plan["active_params"] == active_parameters(config) < plan["params_per_gpu"], preset
    assert active_parameters(get_config("qwen3-30b-a3b")) == 3_353_032_704  # "3.3B activated"


def test_expert_parallelism_in_the_planner_divides_the_experts_and_pays_for_the_all_to_alls(capsys):
    """qwen3-30b-a3b on 8 GPUs, ZeRO-0: ep8 holds 1/8 of every MoE layer's experts,
    so its model states shrink by 7/8 of theirs at 20 bytes each (bf16 Adam), its experts' gradients are reduced
    over no rank (each expert lives once), and each MoE layer's dispatch and combine move the routed rows:
    4 passes x tokens x k x h bf16 values x 7/8 off-rank, 6 passes with the forward recomputed."""
    from mtnlg_lightning.families import expert_parameters_per_layer
    from mtnlg_lightning.gpus import get_gpu
    from mtnlg_lightning.planning.cost_model import Layout, all_to_all_bytes
    from mtnlg_lightning.planning.planner import format_breakdown, format_plan, plan

    config = get_config("qwen3-30b-a3b")
    dense, sparse = (plan(config, 1, 1, 8, 8, "h100-80g", 64, zero_stage=0, recompute="full", ep=ep) for ep in (1, 8))
    experts = sum(expert_parameters_per_layer(config))
    assert dense.params_per_gpu == count_parameters(config) and sparse.ep == 8
    assert dense.params_per_gpu - sparse.params_per_gpu == experts - experts // 8
    assert (dense.model_state_gb - sparse.model_state_gb) * 1e9 == pytest.approx((experts - experts // 8) * 20)
    assert dense.breakdown["ep_comm"] == 0 < sparse.breakdown["ep_comm"]
    assert sparse.breakdown["dp_comm"] < dense.breakdown["dp_comm"]  # only the dense part is all-reduced
    bytes_per_layer = 4 * config.seq_len * config.experts_per_token * config.hidden_size * 2 * 7 / 8
    assert all_to_all_bytes(config, Layout(1, 1, 8, ep=8)) == bytes_per_layer
    assert all_to_all_bytes(config, Layout(2, 1, 8, ep=8, sequence_parallel=True)) == bytes_per_layer / 2
    gpu = get_gpu("h100-80g")
    link = gpu.nvlink_gbps * gpu.nvlink_efficiency * 1e9  # TP 1 x EP 8 fits a node: NVLink
    seconds = 8 * config.num_layers * 1.5 * bytes_per_layer / link  # 8 micro-batches, 48 MoE layers, recomputed
    assert sparse.breakdown["ep_comm"] == pytest.approx(seconds)
    assert "EP all-to-all" in format_breakdown(sparse) and "EP 8 of the DP ranks" in format_plan(sparse)


def test_the_planner_searches_expert_parallel_layouts_the_trainer_runs(tmp_path, capsys):
    """An MoE model's search adds each EP dividing dp and the experts; what it lists the trainer accepts (EP with
    ZeRO 0-2 with or without PP, ZeRO-3 without); the written strategy names expert_parallel."""
    args = ["--model", "qwen3-30b-a3b", "--search", "--gpus", "64", "--gpu", "h100-80g", "--global-batch", "256"]
    assert plan_main([*args, "--top", "500", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    with_experts_split = [p for p in plans if p["ep"] > 1]
    assert with_experts_split and {p["zero_stage"] for p in with_experts_split} == {0, 1, 2, 3}
    assert any(p["pp"] > 1 for p in with_experts_split)  # the experts split over pipeline stages too
    assert all(p["dp"] % p["ep"] == 0 and 128 % p["ep"] == 0 for p in with_experts_split)
    best = min(with_experts_split, key=lambda p: p["iteration_seconds"])
    strategy = tmp_path / "ep.yaml"
    flags = ["--tp", str(best["tp"]), "--cp", str(best["cp"]), "--pp", str(best["pp"]), "--dp", str(best["dp"])]
    flags += ["--ep", str(best["ep"]), "--virtual-stages", str(best["virtual_stages"])]
    layout = [
        *flags,
        "--zero-stage",
        str(best["zero_stage"]),
        "--micro-batch",
        str(best["micro_batch"]),
        "--global-batch",
        "256",
    ]
    recompute = ["--recompute", best["recompute"], *(["--sequence-parallel"] if best["sequence_parallel"] else [])]
    common = ["--model", "qwen3-30b-a3b", "--gpu", "h100-80g", *layout, *recompute]
    assert plan_main([*common, "--json", "--write-config", str(strategy)]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_seconds"] == pytest.approx(best["iteration_seconds"])
    assert f"expert_parallel: {best['ep']}" in strategy.read_text()
    assert plan_main(["--model", "tiny-llama", "--search", "--gpus", "8", "--json", "--top", "500"]) == 0
    assert {p["ep"] for p in json.loads(capsys.readouterr().out)} == {1}  # a dense model: no expert to split


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dp", "2", "--ep", "4"], "expert_parallel 4 does not divide the data-parallel size 2"),
        (["--model", "tiny-llama", "--dp", "2", "--ep", "2"], "expert_parallel 2 needs a mixture-of-experts model"),
    ],
)
def test_the_planner_refuses_an_expert_layout_the_trainer_refuses_in_one_line(args, message, capsys):
    base = ["--model", "qwen3-30b-a3b", "--tp", "1", "--pp", "1", "--zero-stage", "0"]
    assert plan_main([*base, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mtnlg-plan: error: {message}") and "\n" not in err


def test_flops_per_token_count_the_active_experts():
    from mtnlg_lightning.train.flops import forward_flops_per_token

    dense, sparse = get_config("tiny-llama"), tiny_moe(shared_expert_ffn_hidden_size=0, moe_ffn_hidden_size=160)
    # 2 of 4 experts as wide as the dense MLP: twice its matmul FLOPs, plus the router's 2 x H x E.
    mlp = 2 * 3 * 64 * 160 * dense.num_layers
    router = 2 * 64 * 4 * dense.num_layers
    assert forward_flops_per_token(sparse) - forward_flops_per_token(dense) == mlp + router


# ------------------------------------------------------------------------------------------- bad input
def test_bad_moe_settings_are_one_line():
    with pytest.raises(MTNLGError, match="experts_per_token 5 must be between 1 and num_experts 4"):
        tiny_moe(experts_per_token=5)
    with pytest.raises(MTNLGError, match="router 'top1' is not one of softmax, sigmoid"):
        tiny_moe(router="top1")
    with pytest.raises(MTNLGError, match="router_bias_update_rate moves the sigmoid router's expert bias"):
        tiny_moe(router_bias_update_rate=0.01)
    with pytest.raises(MTNLGError, match="router_bias_update_rate must be a number >= 0"):
        tiny_moe(router="sigmoid", router_bias_update_rate=-0.01)
    with pytest.raises(MTNLGError, match="capacity_factor must be positive"):
        tiny_moe(capacity_factor=0)


def test_an_unsupported_moe_design_is_one_line(family_dir, tmp_path, capsys):
    copy = tmp_path / "deepseek"
    shutil.copytree(family_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v2"}))
    capsys.readouterr()
    assert generate_main(["--checkpoint", str(copy), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "deepseek_v2 mixture of experts" in err[0] and "multi-head latent attention" in err[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_moe_model_generates_and_scores_in_tp2_what_it_does_in_one_process(tmp_path, capfd):
    """Qwen 2-MoE (a shared expert, split over TP as a dense MLP; the router and experts whole on each rank) on 2
    ranks: the same greedy text and the same perplexity (rel 1e-5) as one process."""
    from mtnlg_lightning.evaluation.cli import main as eval_main

    directory = random_moe_dir(tmp_path / "qwen2_moe", "qwen2_moe")
    text = tmp_path / "text.txt"
    text.write_text("Return the value of the argument. If the file does not exist, the function raises an error. " * 4)
    source = ["--checkpoint", str(directory), "--dtype", "fp32"]
    greedy = ["--prompt", "The value of the argument is", "--max-new-tokens", "24", "--temperature", "0"]
    printed, perplexity = [], []
    for where in ([], ["--strategy", "strategy/tp2", "--devices", "2"]):
        capfd.readouterr()
        assert generate_main([*source, *greedy, *where]) == 0
        printed.append(capfd.readouterr().out.splitlines()[-1])  # the text (after any library's start-up notice)
        out = tmp_path / f"perplexity{len(where)}.json"
        scored = ["--task", "perplexity", "--data", str(text), "--stride", "16", "--no-progress", "--output", str(out)]
        assert eval_main([*source, *scored, *where]) == 0
        perplexity.append(json.loads(out.read_text())["results"]["perplexity"]["-"]["perplexity"])
    assert printed[1] == printed[0] and printed[0].startswith("The value of the argument is")
    assert perplexity[1] == pytest.approx(perplexity[0], rel=1e-5)


def test_moe_models_refuse_the_layouts_not_built_yet():
    from mtnlg_lightning.parallel.config import ParallelConfig

    config = tiny_moe()
    ParallelConfig().validate(config, 2)  # one process or plain data parallelism
    ParallelConfig(tensor_parallel=2, sequence_parallel=True).validate(config, 2)  # experts whole on each TP rank
    ParallelConfig(pipeline_parallel=2).validate(config, 2)  # the router statistics travel between the stages
    ParallelConfig(pipeline_parallel=2, expert_parallel=2).validate(config, 4, inference=True)  # and generation
    for zero_stage in (0, 1, 2, 3):  # dp2, the experts split in two (their ZeRO state over the ranks holding them)
        ParallelConfig(expert_parallel=2, zero_stage=zero_stage).validate(config, 2)
    with pytest.raises(MTNLGError, match="num_experts 4 is not divisible by expert_parallel 3"):
        ParallelConfig(expert_parallel=3, zero_stage=0).validate(config, 3)
    with pytest.raises(MTNLGError, match="expert_parallel 2 needs a mixture-of-experts model"):
        ParallelConfig(expert_parallel=2, zero_stage=0).validate(get_config("tiny-llama"), 2)


# ------------------------------------------------------------------------------------------- training
def test_the_training_objective_is_transformers_loss_with_router_logits(tmp_path):
    """A Qwen 3-MoE directory with output_router_logits: our module's loss on its own forward is transformers'
    cross-entropy + router_aux_loss_coef x its load-balancing loss (and the z-loss joins with its coefficient)."""
    from mtnlg_lightning.loss import cross_entropy
    from mtnlg_lightning.train.module import MTNLGModule

    directory = random_moe_dir(tmp_path, "qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.25)
    module = MTNLGModule(preset="tiny", init_from=str(directory))
    module.configure_model()
    assert module.config.router_aux_loss_coef == 0.25
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), heads_in_loss(module.model):  # as a training step runs it: the loss applies the head
        theirs = hf_model(directory)(tokens, labels=tokens)
        ours = module.loss_fn(module.model(tokens)[:, :-1], tokens[:, 1:])
    assert theirs.aux_loss > 0
    torch.testing.assert_close(ours, theirs.loss, rtol=1e-5, atol=0)
    assert module.loss_fn.last["router_aux_loss"] == pytest.approx(theirs.aux_loss.item(), rel=1e-5)
    module.config.router_z_loss_coef = module.loss_fn.z_coef = 0.5
    with torch.no_grad(), heads_in_loss(module.model):
        with_z = module.loss_fn(module.model(tokens)[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(with_z, ours + 0.5 * module.loss_fn.last["router_z_loss"], rtol=1e-6, atol=0)
    assert MTNLGModule(preset="tiny-llama").loss_fn is cross_entropy  # a dense model keeps the plain objective


@pytest.mark.slow
def test_fit_trains_a_moe_model_in_one_process_and_logs_the_router_losses_and_expert_loads(tmp_path, demo_data):
    import csv

    from conftest import run_cli

    moe_options = {"family": "mixtral", "num_experts": 4, "experts_per_token": 2, "moe_ffn_hidden_size": 64}
    moe_options |= {"router_aux_loss_coef": 0.01}
    out = run_cli(
        *["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "6", "--model.preset", "tiny-llama"],
        *["--model.model_overrides", json.dumps({**moe_options, "router_z_loss_coef": 0.001})],
        *["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path)],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (metrics,) = tmp_path.rglob("metrics.csv")
    rows = [row for row in csv.DictReader(metrics.open()) if row.get("train_loss")]
    assert len(rows) == 6
    assert all(float(row["router_aux_loss"]) >= 1.0 and float(row["router_z_loss"]) > 0 for row in rows)
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    assert "moe_dropped_tokens" not in rows[0]  # dropless
    # each MoE layer's tokens per expert: every token of the step's global batch counted k = 2 times
    layers = sorted({key.split("/")[1] for key in rows[0] if key.startswith("moe_tokens/")})
    assert layers == ["blocks.0.mlp", "blocks.1.mlp"]
    for row in rows:
        step_tokens = float(row["global_batch_size"]) * float(row["consumed_tokens"]) / float(row["consumed_samples"])
        for layer in layers:
            per_expert = [float(row[f"moe_tokens/{layer}/expert_{e}"]) for e in range(4)]
            assert sum(per_expert) == 2 * step_tokens
            assert float(row[f"moe_max_load/{layer}"]) == pytest.approx(max(per_expert) / (sum(per_expert) / 4))


def test_dropped_tokens_are_reported_with_the_router_losses():
    from mtnlg_lightning.train.module import MTNLGModule

    overrides = {"family": "mixtral", "num_experts": 4, "experts_per_token": 2, "moe_ffn_hidden_size": 64}
    overrides |= {"capacity_factor": 0.5}
    module = MTNLGModule(preset="tiny-llama", model_overrides=overrides)
    module.configure_model()
    tokens = torch.randint(0, 4096, (2, 33), generator=torch.Generator().manual_seed(0))
    with heads_in_loss(module.model):
        module.loss_fn(module.model(tokens[:, :-1]), tokens[:, 1:])
    dropped = sum(layer.stats.dropped for _, layer in moe.moe_layers(module.model))
    assert module.loss_fn.last["moe_dropped_tokens"].item() == dropped > 0
