"""Model-space weights <-> Hugging Face `DeepseekV3ForCausalLM` (DeepSeek-V3 and R1, Kimi K2) and
`Glm4MoeForCausalLM` (GLM-4.5 and 4.6), both ways, exactly, and their `config.json` <-> `ModelConfig`.

Both route as DeepSeek-V3 (sigmoid scores, the balancing bias, groups, `routed_scaling_factor`, ungated shared
experts, the first `first_k_dense_replace` blocks dense). The router's bias is a buffer here (`mlp.expert_bias`),
Hugging Face's `mlp.gate.e_score_correction_bias`. Experts are stacked [E, out, in] here and one tensor per expert
there (`mlp.experts.{j}.gate_proj.weight`, as shipped and as transformers writes them). DeepSeek-V3's attention is
multi-head latent attention (`mla.py`): its `kv_a_proj_with_mqa` ([latent | rotary key] rows) is our `kv_down` and
`k_rope`, rows of one tensor; the other names map one to one, layouts unchanged (the rotary dims stay in the
checkpoint's interleaved order: `rope_interleave`). GLM-4.5's attention is grouped-query attention with optional q/k/v
biases and q/k norms, its rotation over the first `partial_rotary_factor` of each head's dims, as Llama's files
(`llama_mapping`).

Multi-token-prediction layers (`num_nextn_predict_layers`, stored as layers past `num_hidden_layers`, `mtp.py`):
left unread unless the run asks for them (`model.mtp_layers`, 0 by default: fine-tuning usually drops them, as
transformers' `DeepseekV3ForCausalLM` does); then depth k is layer num_hidden_layers + k: `enorm`, `hnorm`,
`eh_proj`, `shared_head.norm` (our depth's `norm`) and a whole block under the block's names (of the last block's
kind), and a checkpoint holding another number of them is one line. Each such layer's `embed_tokens` and
`shared_head.head` are copies of the shared embedding and head: not read, and written as copies on export (vLLM's
MTP reads them), with `num_nextn_predict_layers` = mtp_layers.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mtnlg_lightning.checkpoint.safetensors_shards import TensorSpec
from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import family_of, hf_tensors, measure, path_in_block, stacked_over_experts
from mtnlg_lightning.family_specs import DEEPSEEK_V3, GLM4_MOE
from mtnlg_lightning.interop import llama_mapping

BY_MODEL_TYPE = {family.hf_model_type: family for family in (DEEPSEEK_V3, GLM4_MOE)}
MODEL_TYPES = tuple(BY_MODEL_TYPE)
HEAD = llama_mapping.HEAD
EXPERT_BIAS = "e_score_correction_bias"  # Hugging Face's name of the sigmoid router's balancing bias
MTP_LAYER = re.compile(r"model\.layers\.(\d+)\.")  # a layer index past the decoder's: multi-token prediction
# a multi-token prediction depth's own modules (ours: theirs, under its layer), beside its block
MTP_MODULES = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # of the shared embedding and head, in each layer


# ------------------------------------------------------------------------------------------------ config.json
def _positive(cfg: dict, key: str, where: Path, default=None) -> int:
    value = cfg.get(key, default)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise MTNLGError(f"{where}: {key} is {value!r}, expected an integer >= 1")
    return value


def _rope(cfg: dict, where: Path) -> tuple[float, dict | None, float]:
    """(theta, scaling, partial rotary factor): transformers 5 keeps the factor in `rope_parameters`; YaRN's missing
    `factor` is max_position_embeddings / original_max_position_embeddings, as transformers takes it."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    theta, scaling = llama_mapping._rope({**cfg, "rope_parameters": params}, where)
    if scaling is not None and scaling["rope_type"] == "yarn" and scaling.get("factor") is None:
        original = scaling.get("original_max_position_embeddings")
        if isinstance(original, int | float) and original > 0:
            scaling["factor"] = cfg.get("max_position_embeddings", original) / original
    return theta, scaling, float(partial)


def read_config(cfg: dict, path: Path) -> ModelConfig:
    """The architecture of a DeepSeek-V3 or GLM-4.5 `config.json`; what this decoder does not have is one line."""
    where = path / "config.json"
    kind = cfg["model_type"]
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
    sizes += ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
    hidden, layers, heads, vocab, ffn, expert_ffn, experts, per_token = (_positive(cfg, k, where) for k in sizes)
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (this decoder's SwiGLU uses silu)")
    if kind == DEEPSEEK_V3.hf_model_type and cfg.get("attention_bias"):
        problems.append("attention biases")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"routing {cfg.get('topk_method')} / {cfg.get('scoring_func')} (DeepSeek-V3's is noaux_tc)")
    if problems:
        raise MTNLGError(f"{path}: a {kind} model with {', '.join(problems)} cannot be imported")
    theta, scaling, partial = _rope(cfg, where)
    positions = cfg.get("max_position_embeddings") or 2048
    shared = cfg.get("n_shared_experts") or 0
    common = dict(
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        seq_len=positions,
        max_position_embeddings=positions,
        vocab_size=vocab,
        ffn_hidden_size=ffn,
        attention_dropout=cfg.get("attention_dropout", 0.0),
        layernorm_eps=cfg.get("rms_norm_eps", 1e-6),
        init_std=cfg.get("initializer_range", 0.02),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        name=cfg.get("_name_or_path") or path.name,
        family=BY_MODEL_TYPE[kind].name,
        num_experts=experts,
        experts_per_token=per_token,
        moe_ffn_hidden_size=expert_ffn,
        shared_expert_ffn_hidden_size=shared * expert_ffn,
        first_dense_layers=cfg.get("first_k_dense_replace") or 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        expert_groups=cfg.get("n_group") or 1,
        expert_groups_per_token=cfg.get("topk_group") or 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
    )
    if kind == GLM4_MOE.hf_model_type:
        return ModelConfig(
            **common,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            qk_norm=bool(cfg.get("use_qk_norm", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            partial_rotary_factor=partial,
        )
    nope, rope = _positive(cfg, "qk_nope_head_dim", where), _positive(cfg, "qk_rope_head_dim", where)
    return ModelConfig(
        **common,
        head_dim=nope + rope,
        kv_lora_rank=_positive(cfg, "kv_lora_rank", where),
        q_lora_rank=cfg.get("q_lora_rank"),
        qk_rope_head_dim=rope,
        v_head_dim=_positive(cfg, "v_head_dim", where),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def hf_config(transformers, config: ModelConfig, vocab: int, eod_id: int | None, dtype: str):
    """The transformers config of `config`'s family (DeepSeek-V3 or GLM-4.5)."""
    kind = family_of(config, "a Hugging Face export").hf_model_type
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    if dense != list(range(config.first_dense_layers)):
        raise MTNLGError(f"a {kind} model's dense blocks are its first first_dense_layers ones, not {dense}")
    shared, width = config.shared_expert_ffn_hidden_size, config.moe_ffn_hidden_size
    if shared % width:
        raise MTNLGError(f"shared experts of width {shared} are no whole number of experts of width {width}")
    rope = {"rope_theta": config.rope_theta, **(config.rope_scaling or {"rope_type": "default"})}
    common = dict(
        vocab_size=vocab,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        moe_intermediate_size=width,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        n_shared_experts=shared // width,
        n_routed_experts=config.num_experts,
        num_experts_per_tok=config.experts_per_token,
        routed_scaling_factor=config.routed_scaling_factor,
        n_group=config.expert_groups,
        topk_group=config.expert_groups_per_token,
        first_k_dense_replace=config.first_dense_layers,
        norm_topk_prob=config.norm_topk_prob,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.layernorm_eps,
        initializer_range=config.init_std,
        attention_dropout=config.attention_dropout,
        tie_word_embeddings=config.tie_embeddings,
        num_nextn_predict_layers=config.mtp_layers,
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        architectures=[BY_MODEL_TYPE[kind].hf_architecture],
        dtype=dtype,
    )
    if kind == GLM4_MOE.hf_model_type:
        rope["partial_rotary_factor"] = config.partial_rotary_factor
        return transformers.Glm4MoeConfig(
            **common, head_dim=config.head_dim, attention_bias=config.qkv_bias, use_qk_norm=config.qk_norm,
            rope_parameters=rope,
        )  # fmt: skip
    return transformers.DeepseekV3Config(
        **common,
        kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank,
        qk_rope_head_dim=config.qk_rope_head_dim,
        qk_nope_head_dim=config.head_dim - config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rope_interleave=config.rope_interleave,
        rope_parameters=rope,
        attention_bias=False,
    )


# ------------------------------------------------------------------------------------------------ tensors
def sources(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each model-space tensor of `config` (the routers' biases included) and the Hugging Face tensor(s) it is made
    of, in their file order. MLA's `kv_down` and `k_rope` name the same tensor (its rows)."""
    out = {}
    trunk = hf_tensors(family_of(config, "Hugging Face names"), config)
    for ours, theirs in {**trunk, **_depth_sources(config, trunk)}.items():
        out[ours] = theirs
        if ours.endswith(".mlp.router.weight"):
            out[ours.replace("router.weight", "expert_bias")] = (theirs[0].replace("weight", EXPERT_BIAS),)
    return out


def _depth_sources(config: ModelConfig, trunk: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The multi-token prediction depths' tensors (`mtp.layers.K....`) and theirs (`model.layers.{L + K}....`):
    each depth's own modules, then its block named as the trunk's last block is, at the depth's layer."""
    last, out = config.num_layers - 1, {}
    for depth in range(config.mtp_layers):
        layer = f"model.layers.{config.num_layers + depth}."
        for ours, theirs in MTP_MODULES.items():
            out[f"mtp.layers.{depth}.{ours}.weight"] = (f"{layer}{theirs}.weight",)
        for ours, theirs in trunk.items():
            if ours.startswith(f"blocks.{last}."):
                name = ours.replace(f"blocks.{last}.", f"mtp.layers.{depth}.block.", 1)
                out[name] = tuple(t.replace(f"model.layers.{last}.", layer, 1) for t in theirs)
    return out


def sources_in(config: ModelConfig, names) -> dict[str, tuple[str, ...]]:
    """`sources`, checking that a run asking for multi-token prediction depths reads as many as the directory holds
    (`names`: its tensors)."""
    held = {int(m.group(1)) for name in names if (m := MTP_LAYER.match(name)) and int(m.group(1)) >= config.num_layers}
    if config.mtp_layers and len(held) != config.mtp_layers:
        raise MTNLGError(
            f"the checkpoint holds {len(held)} multi-token prediction layer(s) (num_nextn_predict_layers), "
            f"model.mtp_layers asks for {config.mtp_layers}: set mtp_layers to {len(held)}, or 0 to drop them"
        )
    return sources(config)


def row_parts(config: ModelConfig) -> dict[str, tuple[int, int, tuple[str, ...]]]:
    """{our tensor: (first row, end row, every tensor of the group)} of our tensors that are rows of one Hugging
    Face tensor (the spec names it for several modules: MLA's latent, then its rotary key), in the spec's order."""
    owners: dict[str, list[str]] = {}
    for ours, theirs in sources(config).items():
        if len(theirs) == 1:
            owners.setdefault(theirs[0], []).append(ours)
    shapes, parts = measure(config).block, {}
    for names in (names for names in owners.values() if len(names) > 1):
        start = 0
        for name in names:
            module, _, param = name.rpartition(".")
            rows = shapes[path_in_block(module)][param][0]
            parts[name] = (start, start + rows, tuple(names))
            start += rows
    return parts


def from_hf(name: str, tensors: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    part = row_parts(config).get(name)
    if part is not None:
        return tensors[0][part[0] : part[1]]
    return llama_mapping.from_hf(name, tensors, config)


def ours_shape(name: str, shapes: list[tuple[int, ...]], config: ModelConfig) -> tuple[int, ...]:
    part = row_parts(config).get(name)
    if part is not None:
        return (part[1] - part[0], *shapes[0][1:])
    return llama_mapping.ours_shape(name, shapes, config)


def tensor_specs(weights, config: ModelConfig, vocab: int, dtype: torch.dtype) -> list[TensorSpec]:
    """The Hugging Face tensors, each produced rows at a time from boxes of our model-space tensors; one made of
    several of ours (MLA's `kv_a_proj_with_mqa`) from their rows in turn (`row_parts`)."""
    specs, parts = [], row_parts(config)
    for ours, theirs in sources(config).items():
        shape = weights.shape(ours)
        if ours in ("embed.wte.weight", "lm_head.weight"):  # the padded rows and any past the tokenizer's: never
            shape = (vocab, *shape[1:])
        if ours in parts:
            group = parts[ours][2]
            if ours == group[0]:  # written once, with the rows of the others
                whole = (sum(parts[name][1] - parts[name][0] for name in group), *shape[1:])
                specs.append(TensorSpec(theirs[0], whole, dtype, _stacked_rows(weights, group, parts)))
        elif stacked_over_experts(ours):
            for expert, name in enumerate(theirs):
                specs.append(
                    TensorSpec(name, shape[1:], dtype, llama_mapping._expert_rows(weights, ours, shape, expert))
                )
        elif len(theirs) == 3:
            for index, name in enumerate(theirs):
                rows = llama_mapping._qkv_rows(weights, ours, shape, index, config)
                specs.append(TensorSpec(name, (shape[0] // 3, *shape[1:]), dtype, rows))
        else:
            specs.append(TensorSpec(theirs[0], shape, dtype, llama_mapping._box_rows(weights, ours, shape)))
    # each multi-token prediction layer's copies of the shared embedding and head, as DeepSeek's files hold them
    head = "embed.wte.weight" if config.tie_embeddings else "lm_head.weight"
    for depth in range(config.mtp_layers):
        for copy, ours in zip(MTP_COPIES, ("embed.wte.weight", head), strict=True):
            shape = (vocab, *weights.shape(ours)[1:])
            name = f"model.layers.{config.num_layers + depth}.{copy}"
            specs.append(TensorSpec(name, shape, dtype, llama_mapping._box_rows(weights, ours, shape)))
    return specs


def _stacked_rows(weights, group: tuple[str, ...], parts: dict):
    """Rows r0..r1 of the rows of `group`'s tensors one after the other (`row_parts`)."""
    columns = weights.shape(group[0])[1]

    def rows(r0: int, r1: int) -> torch.Tensor:
        pieces = []
        for name in group:
            start, end, _ = parts[name]
            low, high = max(r0, start), min(r1, end)
            if low < high:
                pieces.append(weights.read_box(name, (low - start, 0), (high - low, columns)))
        return torch.cat(pieces)

    return rows


def normalize(name: str) -> str:
    return name


def is_constant(name: str, config: ModelConfig | None = None) -> bool:
    """RoPE's frequencies, and the multi-token-prediction layers (`model.layers.N...` past the config's
    `num_hidden_layers`) where the run asks for none (`mtp_layers` 0), as transformers' model leaves them; where it
    asks for them, their copies of the shared embedding and head."""
    layer = MTP_LAYER.match(name)
    if config is not None and layer is not None and int(layer.group(1)) >= config.num_layers:
        return not config.mtp_layers or name.endswith(MTP_COPIES)
    return llama_mapping.is_constant(name)
