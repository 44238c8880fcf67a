"""Model-space weights <-> Hugging Face `LlamaForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM`, and the
mixtures of experts `Qwen3MoeForCausalLM`, `Qwen2MoeForCausalLM`, `MixtralForCausalLM` and `OlmoeForCausalLM`, both
ways, exactly (no arithmetic on values), and their `config.json` <-> `ModelConfig`.

Names differ, layouts mostly do not: Linear weights are [out, in] on both sides, and the rotary layout is Hugging
Face's (the first half of each head's dims pairs with the second) on both sides, so q and k need no permutation. A
model with as many key/value heads as query heads keeps one fused q/k/v projection here, rows laid out
[heads, 3, head_dim] (a tensor-parallel shard holds whole heads), made of Hugging Face's three. Experts are
stacked [E, out, in] here and one tensor per expert there (`...experts.{j}.gate_proj.weight`, as shipped and as
transformers writes them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtnlg_lightning.checkpoint.safetensors_shards import TensorSpec
from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import family_of, hf_tensors, stacked_over_experts
from mtnlg_lightning.family_specs import LLAMA, MIXTRAL, OLMOE, QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE

# config.json's model_type -> the family spec it is (the MoE families: those with nested experts options)
BY_MODEL_TYPE = {family.hf_model_type: family for family in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, QWEN2_MOE, MIXTRAL, OLMOE)}
MOE_TYPES = tuple(kind for kind, family in BY_MODEL_TYPE.items() if family.experts is not None)
MODEL_TYPES = tuple(BY_MODEL_TYPE)
HEAD = "lm_head.weight"
CONSTANT_BUFFERS = ("rotary_emb.inv_freq",)  # older files carry RoPE's frequencies: constants, not weights


# ------------------------------------------------------------------------------------------------ config.json
def _rope(cfg: dict, where: Path) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 5's `rope_parameters` or 4's `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = None if kind == "default" else {"rope_type": kind, **{k: v for k, v in params.items() if k != "type"}}
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise MTNLGError(f"{where}: rope_theta is {theta!r}, expected a positive number")
    return float(theta), scaling


def hf_block_fields(cfg: dict, heads: int, positions: int, eps: float) -> dict:
    """The ModelConfig fields every Llama-style config.json states alike (sizes, heads, positions, dropout, norm eps,
    init): the part each decoder family's `read_config` shares. `eps`: the family's default rms_norm_eps."""
    return dict(
        hidden_size=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        seq_len=positions,
        max_position_embeddings=positions,
        vocab_size=cfg["vocab_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        attention_dropout=cfg.get("attention_dropout", 0.0),
        layernorm_eps=cfg.get("rms_norm_eps", eps),
        init_std=cfg.get("initializer_range", 0.02),
    )


def read_config(cfg: dict, path: Path) -> ModelConfig:
    """The architecture of a Llama / Qwen 2 / Qwen 3 `config.json`; what this decoder does not have is one line."""
    where = path / "config.json"
    kind = cfg["model_type"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        value = cfg.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise MTNLGError(f"{where}: {key} is {value!r}, expected an integer >= 1")
    problems = []
    if kind in MOE_TYPES:
        problems += _unsupported_experts(cfg, kind)
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (this decoder's SwiGLU uses silu)")
    if cfg.get("use_sliding_window"):
        problems.append("sliding-window attention")
    if cfg.get("mlp_bias"):
        problems.append("MLP biases")
    if kind in (MIXTRAL.hf_model_type,) and cfg.get("sliding_window"):
        problems.append("sliding-window attention")
    if kind not in (QWEN2.hf_model_type, QWEN2_MOE.hf_model_type) and cfg.get("attention_bias"):
        problems.append("attention biases on every projection")
    if problems:
        raise MTNLGError(f"{path}: a {kind} model with {', '.join(problems)} cannot be imported")
    theta, scaling = _rope(cfg, where)
    heads = cfg["num_attention_heads"]
    positions = cfg.get("max_position_embeddings") or 2048
    return ModelConfig(
        num_layers=cfg["num_hidden_layers"],
        **hf_block_fields(cfg, heads, positions, 1e-6),
        position_embedding="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        norm="rmsnorm",
        mlp="swiglu",
        qk_norm=kind in (QWEN3.hf_model_type, QWEN3_MOE.hf_model_type, OLMOE.hf_model_type),
        qk_norm_over="projection" if kind == OLMOE.hf_model_type else "head",
        bias=False,
        qkv_bias=kind in (QWEN2.hf_model_type, QWEN2_MOE.hf_model_type),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        name=cfg.get("_name_or_path") or path.name,
        family=BY_MODEL_TYPE[kind].name,
        **(_read_experts(cfg, kind, where) if kind in MOE_TYPES else {}),
    )


def _unsupported_experts(cfg: dict, kind: str) -> list[str]:
    problems = []
    if cfg.get("router_jitter_noise"):
        problems.append("router jitter noise")
    if cfg.get("clip_qkv") is not None:
        problems.append("q/k/v clipping")
    return problems


def _read_experts(cfg: dict, kind: str, where: Path) -> dict:
    """The mixture-of-experts fields of a Qwen 3-MoE / Qwen 2-MoE / Mixtral / OLMoE config.json. transformers adds
    the auxiliary loss only when `output_router_logits` is set: so does the imported config."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    per_token = cfg.get("num_experts_per_tok")
    for key, value in (("num_experts", experts), ("num_experts_per_tok", per_token)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise MTNLGError(f"{where}: {key} is {value!r}, expected an integer >= 1")
    qwen = kind in (QWEN3_MOE.hf_model_type, QWEN2_MOE.hf_model_type)
    dense = (cfg.get("mlp_only_layers") or []) if qwen else []
    if not (isinstance(dense, list) and all(isinstance(i, int) for i in dense)):
        raise MTNLGError(f"{where}: mlp_only_layers is {dense!r}, expected a list of layer indices")
    coef = cfg.get("router_aux_loss_coef", 0.0) if cfg.get("output_router_logits") else 0.0
    return dict(
        num_experts=experts,
        experts_per_token=per_token,
        moe_ffn_hidden_size=cfg["moe_intermediate_size"] if qwen else cfg["intermediate_size"],
        shared_expert_ffn_hidden_size=(cfg.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0,
        moe_layer_step=(cfg.get("decoder_sparse_step") or 1) if qwen else 1,
        dense_layers=sorted(dense) or None,
        norm_topk_prob=True if kind == MIXTRAL.hf_model_type else bool(cfg.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(coef),
    )


def hf_config(transformers, config: ModelConfig, vocab: int, eod_id: int | None, dtype: str):
    """The transformers config of `config`'s family (`model_type`)."""
    kind = family_of(config, "a Hugging Face export").hf_model_type
    common = dict(
        vocab_size=vocab,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.layernorm_eps,
        initializer_range=config.init_std,
        attention_dropout=config.attention_dropout,
        rope_theta=config.rope_theta,
        rope_scaling=dict(config.rope_scaling) if config.rope_scaling else None,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        architectures=[BY_MODEL_TYPE[kind].hf_architecture],
        dtype=dtype,
    )
    if kind in MOE_TYPES:
        return _moe_config(transformers, kind, config, common)
    if kind == "llama":
        return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, attention_bias=False)
    return transformers.Qwen2Config(**common)


def _moe_config(transformers, kind: str, config: ModelConfig, common: dict):
    """The transformers config of a mixture of experts: Qwen's dense blocks listed as `mlp_only_layers`."""
    experts = dict(
        num_experts_per_tok=config.experts_per_token,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=config.router_aux_loss_coef > 0,
    )
    if kind == MIXTRAL.hf_model_type:
        common["intermediate_size"] = config.moe_ffn_hidden_size
        return transformers.MixtralConfig(
            **common, **experts, num_local_experts=config.num_experts, sliding_window=None
        )
    experts |= dict(num_experts=config.num_experts, norm_topk_prob=config.norm_topk_prob)
    if kind == OLMOE.hf_model_type:
        common["intermediate_size"] = config.moe_ffn_hidden_size
        return transformers.OlmoeConfig(**common, **experts, attention_bias=False, clip_qkv=None)
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    experts |= dict(moe_intermediate_size=config.moe_ffn_hidden_size, decoder_sparse_step=1, mlp_only_layers=dense)
    if kind == QWEN3_MOE.hf_model_type:
        return transformers.Qwen3MoeConfig(**common, **experts, attention_bias=False)
    # Qwen 2-MoE has no head_dim option: its heads are hidden_size / num_attention_heads wide.
    if common.pop("head_dim") * config.num_heads != config.hidden_size:
        raise MTNLGError(f"a Qwen 2-MoE's head_dim is hidden_size / num_heads, not {config.head_dim}")
    shared = config.shared_expert_ffn_hidden_size
    return transformers.Qwen2MoeConfig(**common, **experts, shared_expert_intermediate_size=shared, qkv_bias=True)


# ------------------------------------------------------------------------------------------------ tensors
def sources(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each model-space tensor of `config` and the Hugging Face tensor(s) it is made of, in their file order."""
    return hf_tensors(family_of(config, "Hugging Face names"), config)


def _fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's q, k, v rows -> ours [heads, 3, head_dim] (weight or bias)."""
    rest = q.shape[1:]
    return torch.stack([t.reshape(heads, -1, *rest) for t in (q, k, v)], dim=1).reshape(-1, *rest)


def _split(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest = qkv.shape[1:]
    return tuple(t.reshape(-1, *rest) for t in qkv.reshape(heads, 3, -1, *rest).unbind(dim=1))


def from_hf(name: str, tensors: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    if stacked_over_experts(name):
        return torch.stack(tensors)
    return _fuse(*tensors, config.num_heads) if len(tensors) == 3 else tensors[0]


def ours_shape(name: str, shapes: list[tuple[int, ...]], config: ModelConfig) -> tuple[int, ...]:
    if stacked_over_experts(name):
        return (len(shapes), *shapes[0])
    return (sum(s[0] for s in shapes), *shapes[0][1:]) if len(shapes) == 3 else tuple(shapes[0])


def tensor_specs(weights, config: ModelConfig, vocab: int, dtype: torch.dtype) -> list[TensorSpec]:
    """The Hugging Face tensors, each produced rows at a time from boxes of our model-space tensors (a fused
    q/k/v, small next to the rest, is read whole and split)."""
    specs = []
    for ours, theirs in sources(config).items():
        shape = weights.shape(ours)
        if ours in ("embed.wte.weight", "lm_head.weight"):  # the padded rows and any past the tokenizer's: never
            shape = (vocab, *shape[1:])
        if stacked_over_experts(ours):
            for expert, name in enumerate(theirs):
                specs.append(TensorSpec(name, shape[1:], dtype, _expert_rows(weights, ours, shape, expert)))
        elif len(theirs) == 3:
            for index, name in enumerate(theirs):
                part_shape = (shape[0] // 3, *shape[1:])
                specs.append(TensorSpec(name, part_shape, dtype, _qkv_rows(weights, ours, shape, index, config)))
        else:
            specs.append(TensorSpec(theirs[0], shape, dtype, _box_rows(weights, ours, shape)))
    return specs


def _box_rows(weights, name: str, shape: tuple[int, ...]):
    def rows(r0: int, r1: int) -> torch.Tensor:
        return weights.read_box(name, (r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:]))

    return rows


def _expert_rows(weights, name: str, shape: tuple[int, ...], expert: int):
    def rows(r0: int, r1: int) -> torch.Tensor:
        return weights.read_box(name, (expert, r0, 0), (1, r1 - r0, shape[2]))[0]

    return rows


def _qkv_rows(weights, name: str, shape: tuple[int, ...], index: int, config: ModelConfig):
    def rows(r0: int, r1: int) -> torch.Tensor:
        return _split(weights.read_box(name, (0,) * len(shape), shape), config.num_heads)[index][r0:r1]

    return rows


def normalize(name: str) -> str:
    return name


def is_constant(name: str, config: ModelConfig | None = None) -> bool:
    """RoPE's frequencies, which older files carry: constants, not weights."""
    return name.endswith(CONSTANT_BUFFERS)
