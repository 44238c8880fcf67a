"""The DeepSeek-V3 class (issue 61), proven against transformers: tiny random `DeepseekV3ForCausalLM` directories
(multi-head latent attention with and without the query latent, interleaved rotary dims, YaRN with its attention
factor and softmax-scale correction, sigmoid routing with the balancing bias in 2 groups, ungated shared experts,
the first block dense) and a `Glm4MoeForCausalLM` one (grouped-query attention with q/k/v biases, q/k norms and half
of each head rotating, the same routing) give transformers' logits and greedy text, export back to the same class
and tensors, and cache MLA's latent when decoding."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import test_model_families as dense_families
import torch
from deepseek_models import VARIANTS, random_deepseek_dir

from mtnlg_lightning.checkpoint.safetensors_shards import ShardedTensors
from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation.cli import main as eval_main
from mtnlg_lightning.families import count_parameters, family_of
from mtnlg_lightning.inference.generate_cli import main as generate_main
from mtnlg_lightning.inference.load import load_model
from mtnlg_lightning.model import KVCache, build_model

transformers = pytest.importorskip("transformers")
# A custom block with MLA and DeepSeek-V3's routing (interleaved rotary dims, a query latent, values narrower than
# q/k, 8 experts in 2 groups, shared experts, the first block dense).
MLA_BLOCK = dict(
    family=None, num_kv_heads=4, head_dim=24, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=20, q_lora_rank=12,
    rope_interleave=True, num_experts=8, experts_per_token=2, moe_ffn_hidden_size=16, router="sigmoid",
    expert_groups=2, expert_groups_per_token=1, shared_expert_ffn_hidden_size=16, shared_expert_gated=False,
    first_dense_layers=1,
)  # fmt: skip


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def family_dir(request, tmp_path_factory):
    return random_deepseek_dir(tmp_path_factory.mktemp(request.param), request.param)


def test_each_directory_reads_as_its_family_with_its_routing(family_dir):
    config = load_model(family_dir)[0].config
    source = json.loads((family_dir / "config.json").read_text())
    assert family_of(config).hf_model_type == source["model_type"]
    assert (config.num_experts, config.experts_per_token, config.expert_groups) == (8, 2, 2)
    assert config.expert_groups_per_token == 1 and config.moe_layers == (1, 2) and config.router == "sigmoid"
    assert config.routed_scaling_factor == source["routed_scaling_factor"] and not config.shared_expert_gated
    if source["model_type"] == "deepseek_v3":
        assert config.latent_attention and config.q_lora_rank == source["q_lora_rank"] and config.rope_interleave
        assert (config.head_dim, config.v_head_dim, config.rotary_dim) == (16, 12, 8)
    else:
        assert config.qk_norm and config.qkv_bias and config.rotary_dim == 16 and not config.latent_attention


def test_our_logits_equal_transformers(family_dir):
    dense_families.test_our_logits_equal_transformers(family_dir)


def test_greedy_generation_prints_transformers_continuation(family_dir, capsys):
    capsys.readouterr()  # transformers' progress bars
    dense_families.test_greedy_generation_prints_transformers_continuation(family_dir, capsys)


def test_export_writes_the_same_class_and_tensors_transformers_loads_with_our_logits(family_dir, tmp_path):
    dense_families.test_export_writes_the_family_transformers_loads_with_our_logits(family_dir, tmp_path)
    exported, source = ShardedTensors(tmp_path / "exported"), ShardedTensors(family_dir)
    assert sorted(exported.names) == sorted(source.names)  # per-expert keys, the routers' e_score_correction_bias
    for name in source.names:
        assert torch.equal(exported.read(name), source.read(name)), name
    written = json.loads((tmp_path / "exported" / "config.json").read_text())
    theirs = json.loads((family_dir / "config.json").read_text())
    for key in ("n_group", "topk_group", "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace"):
        assert written[key] == theirs[key], key
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "rope_interleave", "use_qk_norm"):
        assert written.get(key) == theirs.get(key), key


def test_the_mla_cache_holds_the_latent_and_the_rotary_key_only():
    config = get_config("tiny-llama", family=None, num_kv_heads=4, head_dim=24, kv_lora_rank=16, qk_rope_head_dim=8,
                        v_head_dim=20)  # fmt: skip
    model = build_model(config).eval()
    tokens = torch.randint(0, 4096, (3, 9), generator=torch.Generator().manual_seed(0))
    cache = KVCache(32)
    with torch.no_grad():
        model(tokens[:, :8], cache)
        cache.start = 8
        last = model(tokens[:, 8:], cache)
        whole = model(tokens)[:, -1:]
    torch.testing.assert_close(last, whole, rtol=1e-5, atol=1e-5)  # decoding from the latent cache = recomputing
    per_token = (16 + 8) * config.num_layers * 4  # (kv_lora_rank + qk_rope_head_dim) x layers x fp32
    full_heads = config.num_layers * config.num_heads * (24 + 20) * 4  # keys and values of every head
    assert cache.bytes_per_position() == per_token == 192 and full_heads == 1408
    assert all(k.shape == (3, 1, 32, 16) for k in cache.keys.values())


def test_the_meta_model_counts_transformers_parameters(family_dir):
    config = load_model(family_dir)[0].config
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(family_dir))
    assert count_parameters(config) - count_parameters(config, 1) == 0
    padded = (config.padded_vocab_size() - config.vocab_size) * config.hidden_size * (1 if config.tie_embeddings else 2)
    assert count_parameters(config) - padded == sum(p.numel() for p in theirs.parameters())


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(expert_groups=3), "expert_groups 3 does not divide num_experts 8"),
        (dict(expert_groups=2, expert_groups_per_token=3), "expert_groups_per_token 3 must be between 1 and"),
        (dict(expert_groups=4, expert_groups_per_token=1, experts_per_token=3), "experts_per_token 3 is more than"),
        (dict(qk_rope_head_dim=8), "set kv_lora_rank too"),
        (dict(kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, num_kv_heads=2), "num_kv_heads = num_heads"),
    ],
)
def test_bad_routing_and_latent_attention_settings_are_one_line(change, message):
    values = dict(family=None, num_experts=8, experts_per_token=2, moe_ffn_hidden_size=16, router="sigmoid")
    with pytest.raises(MTNLGError, match=message):
        get_config("tiny-llama", **{**values, "head_dim": 16, **change})


def test_packed_documents_attend_within_each_document_as_apart(monkeypatch):
    """MLA with document masks (SDPA's dense mask and FlexAttention's block mask, the values padded to the q/k
    width for them): a row of two packed documents gives each document's logits alone."""
    config = get_config("tiny-llama", **MLA_BLOCK)
    torch.manual_seed(0)
    model = build_model(config).eval()
    tokens = torch.randint(0, 4096, (1, 20), generator=torch.Generator().manual_seed(1))
    documents = torch.tensor([[0] * 7 + [1] * 13])
    positions = torch.cat([torch.arange(7), torch.arange(13)])[None]
    with torch.no_grad():
        apart = torch.cat([model(tokens[:, :7]), model(tokens[:, 7:])], dim=1)
        for kernel in ("sdpa", "flex"):
            monkeypatch.setattr(model, "document_mask_kernel", kernel)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                packed = model(tokens, position_ids=positions, document_ids=documents)
            torch.testing.assert_close(packed, apart, rtol=1e-5, atol=1e-5)


def test_lora_on_the_mla_projections_by_hugging_face_names_exports_a_peft_adapter(family_dir, tmp_path):
    """Adapters on q_b_proj (or q_proj), kv_b_proj and o_proj, the projections split by heads: the PEFT directory
    loads on transformers' model with our logits."""
    if json.loads((family_dir / "config.json").read_text())["model_type"] != "deepseek_v3":
        pytest.skip("MLA's projections")
    from test_lora import _adapter_state, _our_model, _peft_logits

    from mtnlg_lightning.interop.peft_adapter import write_peft_adapter
    from mtnlg_lightning.parallel.lora import LoRAConfig, LoRALinear, apply_lora

    model = _our_model(family_dir)
    q, q_name = ("q", "q_proj") if model.config.q_lora_rank is None else ("q_up", "q_b_proj")
    lora = {"rank": 4, "alpha": 8, "targets": [q_name, "kv_b_proj", "o_proj"]}
    assert LoRAConfig.from_dict(lora).projections(model.config) == (q, "kv_up", "proj")
    apply_lora(model, LoRAConfig.from_dict(lora))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.normal_(0.0, 0.05)
    write_peft_adapter(_adapter_state(model, lora, family_dir), tmp_path / "adapter")
    tokens = torch.randint(0, 4096, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)
    theirs, _ = _peft_logits(family_dir, tmp_path / "adapter", tokens)
    torch.testing.assert_close(theirs, ours[..., : theirs.shape[-1]], rtol=1e-5, atol=1e-5)
    with pytest.raises(MTNLGError, match="targets 'kv_a_proj_with_mqa', which this model does not have"):
        LoRAConfig.from_dict({"targets": ["kv_a_proj_with_mqa"]}).projections(model.config)


def test_a_tp_that_does_not_divide_the_mla_heads_is_one_line(family_dir, tmp_path, capsys):
    if json.loads((family_dir / "config.json").read_text())["model_type"] != "deepseek_v3":
        pytest.skip("MLA's heads")
    strategy = tmp_path / "tp3.yaml"
    strategy.write_text(
        "class_path: mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy\ninit_args: {tensor_parallel: 3}\n"
    )
    capsys.readouterr()
    argv = ["--checkpoint", str(family_dir), "--strategy", str(strategy), "--devices", "3", "--task", "perplexity"]
    assert eval_main([*argv, "--data", str(dense_families.ROOT / "README.md")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "mtnlg-eval: error: num_heads 4 is not divisible by tensor_parallel 3"
    ]


def test_a_checkpoint_s_multi_token_prediction_layer_is_left_unread(family_dir, tmp_path):
    """DeepSeek-V3's and GLM-4.5's checkpoints store their MTP modules as layers past num_hidden_layers
    (`model.layers.3.eh_proj` here): read as transformers reads them, without those layers."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "with_mtp"
    shutil.copytree(family_dir, copy)
    tensors = load_file(copy / "model.safetensors")
    extra = {"model.layers.3.eh_proj.weight": torch.ones(64, 128), "model.layers.3.enorm.weight": torch.ones(64)}
    save_file({**tensors, **extra}, copy / "model.safetensors", metadata={"format": "pt"})
    tokens = torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(4))
    (with_mtp, _), (without, _) = load_model(copy), load_model(family_dir)
    with torch.no_grad():
        assert torch.equal(with_mtp(tokens), without(tokens))


@pytest.mark.slow
@pytest.mark.distributed
def test_an_mla_model_generates_and_scores_in_tp2_what_it_does_in_one_process(tmp_path, capfd):
    """DeepSeek-V3 on 2 tensor-parallel ranks (2 heads each; the latents and the rotary key whole, the latent cache
    on each rank): the same greedy text and the same perplexity (rel 1e-5) as one process."""
    directory = random_deepseek_dir(tmp_path, "deepseek_v3")
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


# ------------------------------------------------------------------------------------------- presets
# transformers' counts of the published configs built on the meta device (no multi-token-prediction layer: it is
# not part of DeepseekV3ForCausalLM / Glm4MoeForCausalLM): DeepSeek-V3 "671B total, 37B activated".
PRESET_COUNTS = {
    "deepseek-v3": (671_026_404_352, 37_552_282_624),
    "kimi-k2": (1_026_408_209_408, 32_861_477_888),
    "glm-4.5": (352_797_814_784, 33_632_251_904),
    "glm-4.5-air": (106_852_245_504, 13_424_123_904),
}


@pytest.mark.parametrize("preset", sorted(PRESET_COUNTS))
def test_the_presets_count_transformers_parameters_and_the_planner_reports_them(preset, capsys):
    from mtnlg_lightning.families import active_parameters
    from mtnlg_lightning.interop import deepseek_mapping
    from mtnlg_lightning.planning.plan_cli import main as plan_main

    config = get_config(preset)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(
            deepseek_mapping.hf_config(transformers, config, config.vocab_size, None, "float32")
        )
    assert type(theirs).__name__ == family_of(config).hf_architecture
    total, active = PRESET_COUNTS[preset]
    assert count_parameters(config) == sum(p.numel() for p in theirs.parameters()) == total
    experts = sum(p.numel() for n, p in theirs.named_parameters() if ".experts." in n)
    share = config.experts_per_token / config.num_experts
    assert active_parameters(config) == count_parameters(config) - round(experts * (1 - share)) == active
    capsys.readouterr()
    assert plan_main(["--model", preset, "--tp", "1", "--pp", "1", "--dp", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["params_per_gpu"], plan["active_params"]) == (total, active)


@pytest.mark.parametrize("preset", sorted(PRESET_COUNTS))
def test_each_preset_s_plan_names_every_module_of_its_dense_and_moe_blocks(preset):
    """As test_families.py checks the presets of one block kind: the family's plan holds each module with
    parameters of both kinds of block, and every Linear layer is a matmul of the plan (MLA's latent projections and
    rotary key whole on every rank)."""
    import dataclasses

    from torch import nn

    from mtnlg_lightning import families, family_specs

    config = get_config(preset)
    family = family_of(config)
    assert family is family_specs.FAMILIES[config.family] and family.contradiction(config) is None
    model = build_model(dataclasses.replace(config, num_layers=config.first_dense_layers + 1), "meta")
    blocks = [model.blocks["0"], model.blocks[str(config.first_dense_layers)]]  # dense, then MoE
    with_params = {n for b in blocks for n, m in b.named_modules() if any(True for _ in m.parameters(recurse=False))}
    linears = {n for b in blocks for n, m in b.named_modules() if isinstance(m, nn.Linear)}
    plan = families.tensor_parallel_plan(config)
    assert set(plan) == with_params and with_params <= set(family.tensor_parallel_plan())
    matmuls = (*family_specs.MATMUL_STYLES, family_specs.LATENT, family_specs.SHARED_KEY)
    shapes = families.measure(config).block  # a latent's norm is LATENT too: a vector, no matmul
    assert {path for path, style in plan.items() if style in matmuls and len(shapes[path]["weight"]) == 2} == linears


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_tensor_parallel_shards_an_mla_block_to_the_single_process_gradients(sequence_parallel):
    """Threads as ranks: MLA's heads split over 2 ranks (q_up, kv_up column-parallel, proj row-parallel), its
    latents whole (run on the sequence shard under SP) and its rotary key whole with its gradient summed: the loss
    and every gradient are one process's."""
    import torch.nn.functional as F
    from threaded_group import tensor_parallel_runs

    config = get_config("tiny-llama", **MLA_BLOCK)
    torch.manual_seed(0)
    reference = build_model(config).double()
    tokens = torch.randint(0, config.vocab_size, (2, 17))
    loss = F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for rank_loss, grads in tensor_parallel_runs(reference, tokens, sequence_parallel):
        assert rank_loss.item() == pytest.approx(loss.item(), rel=1e-6)
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_planner_counts_mla_s_latent_cache_not_every_head_s_keys_and_values():
    """DeepSeek-V3's cache per token: (512 + 64) x 61 layers x 2 bytes, whole on every TP rank; its heads' keys and
    values would be 128 x (192 + 128) x 61 x 2 bytes (71 times more)."""
    from mtnlg_lightning.planning.activations import kv_cache_bytes

    config = get_config("deepseek-v3")
    for tp in (1, 8):
        assert kv_cache_bytes(config, config.num_layers, 1, 1, tp) == (512 + 64) * 61 * 2 == 70_272
    full_heads = config.num_heads * (config.head_dim + config.v_head_dim) * config.num_layers * 2
    assert full_heads == 4_997_120 and full_heads // 70_272 == 71


def test_yarn_scaling_of_a_grouped_query_family_gives_transformers_logits(tmp_path):
    """YaRN (`yarn.py`) is every RoPE family's now: a Qwen 3 directory stretched 4 times past an original context
    of 64 positions (its attention factor 0.1 ln 4 + 1 on cos and sin) gives transformers' logits at 200 tokens."""
    from hf_models import random_family_dir

    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}
    directory = random_family_dir(tmp_path, "qwen3", rope_parameters=yarn, max_position_embeddings=256)
    assert load_model(directory)[0].config.rope_scaling["rope_type"] == "yarn"
    dense_families.test_our_logits_equal_transformers(directory)


def test_qk_clip_refuses_multi_head_latent_attention_in_one_line():
    from mtnlg_lightning.parallel.qk_clip import QKClip

    config = get_config("tiny-llama", **MLA_BLOCK)
    with pytest.raises(MTNLGError, match="^model.qk_clip does not clip multi-head latent attention yet"):
        QKClip(100.0, config.num_layers, config.num_heads, config.num_kv_heads).attach(build_model(config, "meta"))


def test_init_from_refuses_overrides_of_the_latent_attention_and_routing(family_dir):
    from mtnlg_lightning.interop.init_from import config_for_init

    source = load_model(family_dir)[0].config
    for field, value in (("rope_interleave", not source.rope_interleave), ("routed_scaling_factor", 1.0)):
        if getattr(source, field) != value:
            with pytest.raises(MTNLGError, match=f"^model_overrides {field}={value} conflicts with"):
                config_for_init(str(family_dir), "tiny", {field: value, "seq_len": 64})
