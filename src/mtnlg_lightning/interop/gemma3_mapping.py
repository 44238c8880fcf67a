"""Model-space weights <-> Hugging Face `Gemma3ForCausalLM` (`model_type` gemma3_text), both ways, exactly, and its
`config.json` <-> `ModelConfig`.

The tensors are Llama's layout with Gemma's extra norms (`family_specs.GEMMA3`), moved as `llama_mapping` moves them
(no arithmetic on values: Gemma's norm weights are the (1 + w) form's w on both sides). The config carries what
makes Gemma 3 attend differently: `layer_types` (five sliding layers to one full one in the published models),
`sliding_window`, a RoPE base per kind (`rope_parameters.sliding_attention` / `.full_attention`, the full layers'
own scaling), and `query_pre_attn_scalar` (the softmax scale is its -1/2 power, not head_dim's).
"""

from __future__ import annotations

import math
from pathlib import Path

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.family_specs import GEMMA3
from mtnlg_lightning.interop.llama_mapping import (  # noqa: F401 - the tensor moves every mapping module offers
    HEAD,
    from_hf,
    hf_block_fields,
    is_constant,
    normalize,
    ours_shape,
    sources,
    tensor_specs,
)

MODEL_TYPES = (GEMMA3.hf_model_type,)


def _positive(cfg: dict, key: str, where: Path, kind=int):
    value = cfg.get(key)
    if not (isinstance(value, kind | int) and not isinstance(value, bool) and value > 0):
        raise MTNLGError(f"{where}: {key} is {value!r}, expected a positive number")
    return value


def _rope_kinds(cfg: dict, where: Path) -> tuple[float, dict | None, float]:
    """(full base, full scaling, sliding base) from transformers 5's per-kind `rope_parameters` or the older
    `rope_theta` (full) + `rope_local_base_freq` (sliding) + `rope_scaling` (full)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, sliding = dict(params["full_attention"] or {}), dict(params.get("sliding_attention") or {})
    else:
        full = {"rope_theta": cfg.get("rope_theta", 1_000_000.0), **(cfg.get("rope_scaling") or {})}
        sliding = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    if sliding.get("rope_type", "default") != "default":
        raise MTNLGError(f"{where}: the sliding layers' RoPE is {sliding['rope_type']!r}; only their base is read")
    theta, local = full.pop("rope_theta", 1_000_000.0), sliding.get("rope_theta", 10_000.0)
    for name, value in (("full_attention rope_theta", theta), ("sliding_attention rope_theta", local)):
        if not (isinstance(value, int | float) and not isinstance(value, bool) and value > 0):
            raise MTNLGError(f"{where}: {name} is {value!r}, expected a positive number")
    kind = full.get("rope_type", full.get("type", "default"))
    scaling = None if kind == "default" else {"rope_type": kind, **{k: v for k, v in full.items() if k != "type"}}
    return float(theta), scaling, float(local)


def read_config(cfg: dict, path: Path) -> ModelConfig:
    """The architecture of a Gemma 3 text `config.json`; what this decoder does not have is one line."""
    where = path / "config.json"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        _positive(cfg, key, where)
    problems = []
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation {cfg['hidden_activation']!r} (this decoder's Gemma MLP is tanh-GELU)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            problems.append(f"{key} {cfg[key]}")
    if cfg.get("use_bidirectional_attention"):
        problems.append("bidirectional attention")
    if cfg.get("attention_bias"):
        problems.append("attention biases")
    if problems:
        raise MTNLGError(f"{path}: a gemma3_text model with {', '.join(problems)} cannot be imported")
    theta, scaling, local = _rope_kinds(cfg, where)
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % (cfg.get("sliding_window_pattern") or 6) else "full_attention"
        for i in range(layers)
    ]
    sliding = "sliding_attention" in types
    positions = cfg.get("max_position_embeddings") or 131_072
    return ModelConfig(
        num_layers=layers,
        **hf_block_fields(cfg, heads, positions, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        layer_types=list(types),
        sliding_window=cfg.get("sliding_window") if sliding else None,
        sliding_rope_theta=local if sliding else None,
        attention_softmax_scale=_positive(cfg, "query_pre_attn_scalar", where, float) ** -0.5,
        name=cfg.get("_name_or_path") or path.name,
        family=GEMMA3.name,
    )


def _pre_attn_scalar(config: ModelConfig) -> int | float:
    """query_pre_attn_scalar from the softmax scale (its -1/2 power), an integer where it is one (as published)."""
    scale = config.attention_softmax_scale or config.head_dim**-0.5
    value = 1.0 / (scale * scale)
    return round(value) if math.isclose(value, round(value), rel_tol=1e-9) else value


def hf_config(transformers, config: ModelConfig, vocab: int, eod_id: int | None, dtype: str):
    """The transformers `Gemma3TextConfig` of `config`."""
    full = {"rope_type": "default", "rope_theta": config.rope_theta, **(config.rope_scaling or {})}
    local = {"rope_type": "default", "rope_theta": config.sliding_rope_theta or config.rope_theta}
    types = config.layer_types or ["full_attention"] * config.num_layers
    return transformers.Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.layernorm_eps,
        initializer_range=config.init_std,
        attention_dropout=config.attention_dropout,
        rope_parameters={"full_attention": full, "sliding_attention": local},
        layer_types=list(types),
        sliding_window=config.sliding_window or config.max_position_embeddings,
        query_pre_attn_scalar=_pre_attn_scalar(config),
        attention_bias=False,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        pad_token_id=None,
        architectures=[GEMMA3.hf_architecture],
        dtype=dtype,
    )
