"""Each model family is one registered spec (`family_specs.py`), chosen by name (`ModelConfig.family`), and what the
planner, the FLOPs, tensor parallelism and interop know of its shape comes from there (`families.py`): naming a family
gives its options and refuses a contradicting one in one line; the counts measured on a meta-device model equal the
closed forms written below (the block's arithmetic, stated here as the specification) and the planner's; the plan
shards a Qwen 3 block (grouped-query attention with replicated key/value heads, q/k norms) to the single-process
gradients; the Hugging Face key lists are transformers' own; no other source file names the families' modules; and
no other source file derives a family from options."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from mtnlg_lightning import families, family_specs
from mtnlg_lightning.checkpoint.validate import config_of
from mtnlg_lightning.config import PRESETS, ModelConfig, config_from_stored, get_config, stored_preset_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import count_parameters, family_of, matmul_parameters, measure
from mtnlg_lightning.model import build_model
from mtnlg_lightning.planning.planner import balanced_layers, params_per_stage

SRC = Path(__file__).resolve().parents[1] / "src" / "mtnlg_lightning"
# The presets of one block kind with the attention written out below; the DeepSeek-V3 class's (multi-head latent
# attention, the first blocks dense beside MoE ones) count transformers' own models in test_deepseek_v3.py.
UNIFORM = [name for name in PRESETS if PRESETS[name].get("family") not in ("deepseek_v3", "glm4_moe")]


def closed_form(config, tp: int) -> dict[str, int]:
    """Parameters one of `tp` tensor-parallel ranks holds: a block, the embeddings, the final norm, the LM head."""
    h, f, hd = config.hidden_size, config.ffn_hidden_size, config.head_dim
    q, kv = config.num_heads * hd // tp, int(max(config.num_kv_heads / tp, 1.0) * hd)
    matrices = 3 if config.mlp in ("swiglu", "geglu") else 2
    norm = h * (2 if config.norm == "layernorm" and config.bias else 1)
    mlp = matrices * h * f // tp
    if config.moe:  # the MoE presets' blocks are all MoE: a router and E experts, whole on every TP rank
        shared, e, fe = config.shared_expert_ffn_hidden_size, config.num_experts, config.moe_ffn_hidden_size
        mlp = h * e + 3 * e * h * fe
        mlp += 3 * h * shared // tp + h if shared else 0
        mlp += (e + e * (2 * fe + h)) * (config.expert_mlp == "clamped_swiglu")  # GPT-OSS: router, expert biases
    qk_norms = 2 * hd if config.qk_norm_over == "head" else (config.num_heads + config.num_kv_heads) * hd
    norms = 4 if config.post_block_norms else 2  # Gemma's four per block
    gated = 2 if config.attention_output_gate else 1  # Qwen3-Next's q projection makes each head's gate too
    block = h * (gated * q + 2 * kv) + q * h + mlp + norms * norm + qk_norms * config.qk_norm
    block += (q + 2 * kv) * config.qkv_bias + ((matrices - 1) * f // tp + 2 * h) * config.bias  # h: proj, fc2
    block += h * (config.attention_output_bias and not config.bias) + q // hd * config.attention_sinks
    vocab = config.padded_vocab_size(tp) * h // tp
    positions = config.max_position_embeddings * h if config.position_embedding == "learned" else 0
    form = {"block": block, "embeddings": vocab + positions, "norm": norm, "head": vocab}
    if config.layer_types and "linear_attention" in config.layer_types:  # Gated DeltaNet in place of attention
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv, kernel = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim
        projections = h * (2 * nk * dk + 2 * nv * dv + 2 * nv) // tp + nv * dv * h // tp  # qkvz, ba; out
        # split by key heads too: the conv's channels, A_log and dt_bias; whole: the gated norm
        heads = ((2 * nk * dk + nv * dv) * kernel + 2 * nv) // tp
        form["linear_block"] = projections + heads + dv + mlp + norms * norm
    return form


def layer_params(config, form: dict) -> list[int]:
    """Each layer's parameters in the closed form (a Gated DeltaNet layer's, or an attention layer's)."""
    kinds = config.layer_types or ["full_attention"] * config.num_layers
    return [form["linear_block"] if kind == "linear_attention" else form["block"] for kind in kinds]


@pytest.mark.parametrize("preset", UNIFORM)
def test_the_measured_count_equals_the_closed_form_and_the_planner_s(preset):
    config = get_config(preset)
    form = closed_form(config, 1)
    whole = sum(layer_params(config, form)) + form["embeddings"] + form["norm"]
    whole += 0 if config.tie_embeddings else form["head"]
    assert count_parameters(config) == whole == params_per_stage(config, 1, 1, [config.num_layers])[0]
    for tp in (2, 4, 8):
        if config.num_heads % tp == 0:
            form, layers = closed_form(config, tp), balanced_layers(config.num_layers, 2)
            per_layer = layer_params(config, form)
            first = sum(per_layer[: layers[0]]) + form["embeddings"]
            last = sum(per_layer[layers[0] :]) + form["norm"] + form["head"]  # the tied head's copy too
            assert params_per_stage(config, tp, 2, layers) == [first, last], (preset, tp)


@pytest.mark.parametrize("preset", ["tiny", "demo", "tiny-llama", "demo-llama"])
def test_the_measurement_of_one_block_is_the_whole_meta_model_s(preset):
    config = get_config(preset)
    model = build_model(config, "meta")
    assert sum(p.numel() for p in model.parameters()) == count_parameters(config)
    shapes = measure(config)
    for name, param in model.named_parameters():
        module, _, kind = name.rpartition(".")
        if module.startswith("blocks."):
            assert shapes.block[module.split(".", 2)[2]][kind] == tuple(param.shape), name
        else:
            assert shapes.top[module][kind] == tuple(param.shape), name


@pytest.mark.parametrize("preset", UNIFORM)
def test_matmul_weights_per_token_follow_the_closed_form(preset):
    config = get_config(preset)
    h, hd, f = config.hidden_size, config.head_dim, config.ffn_hidden_size
    attention = h * hd * (2 * config.num_heads + 2 * config.num_kv_heads)  # q, o and k, v
    attention += h * hd * config.num_heads * bool(config.attention_output_gate)  # the gates' half of q
    mlp = (3 if config.mlp in ("swiglu", "geglu") else 2) * h * f
    if config.moe:  # the router and the k experts a token goes to (and a shared expert with its gate)
        mlp = h * config.num_experts + config.experts_per_token * 3 * h * config.moe_ffn_hidden_size
        mlp += (3 * h * config.shared_expert_ffn_hidden_size + h) * bool(config.shared_expert_ffn_hidden_size)
    kinds = config.layer_types or ["full_attention"] * config.num_layers
    nk, nv = config.linear_num_key_heads or 0, config.linear_num_value_heads or 0
    dk, dv = config.linear_key_head_dim or 0, config.linear_value_head_dim or 0
    linear = h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * h  # Gated DeltaNet's in and out projections
    mixers = sum(linear if kind == "linear_attention" else attention for kind in kinds)
    assert matmul_parameters(config) == mixers + config.num_layers * mlp + h * config.padded_vocab_size()


@pytest.mark.parametrize("preset", UNIFORM)
def test_every_preset_names_one_family_whose_plan_names_each_module_of_its_block(preset):
    config = get_config(preset)
    family = family_of(config)
    assert family is family_specs.FAMILIES[config.family] and family.contradiction(config) is None
    with_params, linears = set(), set()
    for kind in sorted(set(config.layer_types or [None])):  # one block of each attention kind
        local = config.sliding_rope_theta if kind == "sliding_attention" else None
        one = dataclasses.replace(config, num_layers=1, layer_types=[kind] if kind else None, sliding_rope_theta=local)
        block = build_model(one, "meta").blocks["0"]
        with_params |= {name for name, m in block.named_modules() if any(True for _ in m.parameters(recurse=False))}
        linears |= {name for name, m in block.named_modules() if isinstance(m, nn.Linear)}
    plan = families.tensor_parallel_plan(config)
    assert set(plan) == with_params and with_params <= set(family.tensor_parallel_plan())
    assert {path for path, style in plan.items() if style in family_specs.MATMUL_STYLES} == linears


def test_a_block_mixing_the_families_options_is_still_planned_and_counted():
    config = get_config("tiny", family=None, num_kv_heads=2, mlp="swiglu", qk_norm=True)  # no family has it
    assert config.family is None
    with pytest.raises(MTNLGError, match="^a Hugging Face export needs a model family, and this model names none"):
        family_of(config, "a Hugging Face export")
    assert set(families.tensor_parallel_plan(config)) >= {"attn.q", "attn.k", "mlp.gate", "attn.q_norm"}
    assert count_parameters(config) == sum(p.numel() for p in build_model(config, "meta").parameters())


def test_the_hugging_face_key_lists_are_transformers_own():
    transformers = pytest.importorskip("transformers")
    from mtnlg_lightning.interop import gpt2_mapping, llama_mapping

    cases = [
        (get_config("tiny"), gpt2_mapping),
        (get_config("tiny-llama"), llama_mapping),
        (get_config("tiny-llama", tie_embeddings=True, num_kv_heads=4), llama_mapping),  # fused q/k/v, tied head
        (get_config("tiny-llama", family="qwen2"), llama_mapping),  # q/k/v biases
        (get_config("tiny-llama", family="qwen3"), llama_mapping),  # q/k norms
    ]
    for config, mapping in cases:
        hf_config = mapping.hf_config(transformers, config, config.vocab_size, None, "float32")
        with torch.device("meta"):
            theirs = transformers.AutoModelForCausalLM.from_config(hf_config)
        names = {n for n, _ in theirs.named_parameters()} - ({mapping.HEAD} if config.tie_embeddings else set())
        listed = [name for sources in mapping.sources(config).values() for name in sources]
        assert sorted(listed) == sorted(names), family_of(config).name


def test_tensor_parallel_shards_a_qwen3_block_as_its_plan_says_to_the_single_process_gradients():
    import torch.distributed as dist
    import torch.nn.functional as F
    from threaded_group import run_ranks

    from mtnlg_lightning.parallel.tensor_parallel import (
        apply_tensor_parallel,
        gather_tensor_parallel,
        vocab_parallel_cross_entropy,
    )

    config = get_config("tiny-llama", family="qwen3")  # 4 query heads, 2 key/value heads
    assert family_of(config) is family_specs.QWEN3
    torch.manual_seed(0)
    reference = build_model(config).double()
    tokens = torch.randint(0, config.vocab_size, (2, 17))
    loss = F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}

    def rank_fn(rank: int, size: int):
        group = dist.group.WORLD
        pairs = [dist.new_group([r, r + 1]) for r in range(0, size, 2)] if size == 4 else []
        kv_group = pairs[rank // 2] if pairs else None  # TP 4 over 2 key/value heads: each held by 2 ranks
        model = apply_tensor_parallel(copy.deepcopy(reference), group, rank, size, kv_group=kv_group)
        loss = vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], group)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            full = gather_tensor_parallel(p.grad, p.partition_dim, group) if hasattr(p, "partition_dim") else p.grad
            if hasattr(p, "partition_dim") and p.partition_count < size:  # copies: keep one of each
                full = full.chunk(size)[:: size // p.partition_count]
                full = torch.cat(full, dim=p.partition_dim)
            grads[name] = full
        return loss.detach(), grads

    for size in (2, 4):
        for rank_loss, grads in run_ranks(size, lambda rank, size=size: rank_fn(rank, size)):
            assert rank_loss.item() == pytest.approx(loss.item(), rel=1e-6)  # the vocab-parallel loss runs in fp32
            assert grads.keys() == expected.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=f"tp{size} {name}")


def test_the_families_modules_and_hugging_face_names_are_written_in_families_py_only():
    """One definition: outside family_specs.py (and model.py, which builds the modules), no source file names a
    block's module path or a Hugging Face module, and apply_tensor_parallel reads the plan instead of naming
    projections."""
    written = {
        name.removeprefix(family_specs.BLOCK)
        for family in family_specs.FAMILIES.values()
        for path, (_, theirs) in family.modules.items()
        for name in (path, *((theirs,) if isinstance(theirs, str) else theirs or ()))
        if "." in name
    }
    leaves = {name.rpartition(".")[2] for name in written}
    leaves = {leaf for leaf in leaves if "_" in leaf}  # Hugging Face's own words (q_proj, c_attn, ln_f, ...)
    pattern = re.compile(
        r"[\"'](?:[\w.{}]*\.)?(" + "|".join(map(re.escape, sorted(written | leaves))) + r")[\"']", re.ASCII
    )
    allowed = {"family_specs.py", "model.py"}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name in allowed:
            continue
        for match in pattern.finditer(path.read_text(encoding="utf-8")):
            found.append(f"{path.relative_to(SRC)}: {match.group(0)}")
    # GPT-2 stores the fused q/k/v with its heads in another order: the one layout conversion, named where it is
    # (the PEFT adapter writer applies it to a LoRA B too); peft's `target_modules` tells GPT-2's two `c_proj`
    # modules apart by a dotted suffix; the planner puts the word and position embeddings on the first pipeline
    # stage, as the pipeline split does.
    assert found == [
        'interop/gpt2_mapping.py: "attn.qkv"',
        'interop/peft_adapter.py: "attn.qkv"',
        'interop/peft_adapter.py: "attn.c_proj"',
        'interop/peft_adapter.py: "mlp.c_proj"',
        'interop/peft_adapter.py: "c_proj"',
        'planning/planner.py: "embed.wte"',
        'planning/planner.py: "embed.wpe"',
    ]
    tp_source = (SRC / "parallel" / "tensor_parallel.py").read_text(encoding="utf-8")
    apply = tp_source[tp_source.index("def apply_tensor_parallel") : tp_source.index("def gather_tensor_parallel")]
    assert not re.search(r"\.(qkv|q|k|v|proj|fc1|fc2|gate|up|down|q_norm|k_norm|ln1|ln2)\b", apply)


# ------------------------------------------------------------------------------------------------ named, not guessed
SIZES = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, seq_len=64, vocab_size=256)
EXPERTS = dict(num_experts=4, experts_per_token=2, shared_expert_ffn_hidden_size=32)


@pytest.mark.parametrize("name", list(family_specs.FAMILIES))
def test_naming_a_family_gives_its_options(name):
    family = family_specs.FAMILIES[name]
    experts = (
        {**EXPERTS, "shared_expert_ffn_hidden_size": 32 if family.experts.shared_expert else 0}
        if family.experts
        else {}
    )
    latent = dict(kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16) if family.latent_attention else {}
    config = ModelConfig(**SIZES, **experts, **latent, family=name)
    assert {key: getattr(config, key) for key in family.options} == family.options
    assert family_of(config) is family and config.moe == (family.experts is not None)


def test_an_option_contradicting_the_named_family_is_refused_in_one_line():
    cases = {
        ("tiny-llama", "qk_norm", True): "qk_norm=True (a llama model has qk_norm=False) contradicts family llama",
        ("tiny", "position_embedding", "rope"): "position_embedding='rope' (a gpt model has position_embedding=",
        ("tiny", "num_kv_heads", 2): "num_kv_heads=2 (a gpt model has num_kv_heads = num_heads) contradicts family gpt",
        ("tiny-llama", "num_experts", 4): "num_experts=4 (a llama model is dense: num_experts=0) contradicts family",
    }
    for (preset, option, value), message in cases.items():
        with pytest.raises(MTNLGError) as error:
            get_config(preset, **{option: value})
        assert str(error.value).startswith(f"model option {message}") and "\n" not in str(error.value)
        assert str(error.value).endswith("name the family it belongs to, or set family null for a custom block")
    with pytest.raises(MTNLGError, match=r"^model option num_experts=0 \(a mixtral model is a mixture of experts"):
        ModelConfig(**SIZES, family="mixtral")
    with pytest.raises(MTNLGError, match=r"^model family 'llama3' is not one of gpt, llama, qwen2, qwen3, "):
        get_config("tiny", family="llama3")


def test_a_config_without_a_family_is_a_custom_block_of_the_mt_nlg_defaults():
    config = ModelConfig(**SIZES)
    assert config.family is None and (config.position_embedding, config.norm, config.mlp) == (
        "learned",
        "layernorm",
        "gelu",
    )
    assert families.plan_of(config) is family_specs.TENSOR_PARALLEL_PLAN  # every family's paths: still sharded
    assert families.plan_of(get_config("tiny")) == family_specs.GPT.tensor_parallel_plan()


@pytest.mark.parametrize("preset", list(PRESETS))
def test_an_old_config_without_the_name_still_loads_with_its_family_from_its_options(preset):
    """A config stored before configs named their family: `config_from_stored` derives it (the one place)."""
    config = get_config(preset)
    stored = {key: value for key, value in dataclasses.asdict(config).items() if key != "family"}
    assert config_from_stored(stored) == config
    mixed = dataclasses.asdict(get_config("tiny", family=None, num_kv_heads=2))
    del mixed["family"]
    assert config_from_stored(mixed).family is None  # no family has this block's options: a custom block
    assert config_of({"model_config": stored}, "manifest.json") == config  # a checkpoint folder's manifest
    # a Lightning .ckpt of an init_from run: the source's options recorded over the default preset, no family
    overrides = {key: value for key, value in stored.items() if key != "name"}
    assert stored_preset_config("tiny", overrides) == dataclasses.replace(config, name="tiny")


def test_no_other_source_file_derives_a_family_from_options():
    """The family is named: outside config.py's check of a named family and its derivation for stored configs of an
    earlier version (`config_from_stored`), nothing compares a config with the families' options."""
    found = {
        f"{path.relative_to(SRC)}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if re.search(r"\.contradiction\(|\bholds\(|family_of\(config\)\s+is\s+None", line)
    }
    assert found == {
        "config.py: wrong = family_spec(config.family).contradiction(config)",
        "config.py: matching = [name for name, family in FAMILIES.items() if family.contradiction(config) is None]",
    }
