"""`--model.init_from PATH`: start a run from the weights of a Hugging Face directory (GPT-2, Llama, Qwen 2, Qwen 3)
or a project checkpoint.

The architecture comes from the source. `model_overrides` may set what does not change the weights' shapes or
meaning (seq_len up to the source's position table, dropout, init_std, vocabulary padding); an architecture field
that differs from the source is a one-line error. The weights are copied into the full model right after it is
built, before any strategy shards it, so every layout starts from the same numbers; the optimizer starts fresh.
"""

from __future__ import annotations

import dataclasses

from mtnlg_lightning.checkpoint.model_state import load_model_space
from mtnlg_lightning.config import PRESETS, ModelConfig, typed_overrides
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.interop.hf import read_source, source_config

ARCHITECTURE = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "vocab_size",
    "ffn_hidden_size",
    "max_position_embeddings",
    "layernorm_eps",
    "position_embedding",
    "rope_theta",
    "rope_scaling",
    "norm",
    "mlp",
    "num_kv_heads",
    "head_dim",
    "qk_norm",
    "bias",
    "qkv_bias",
    "tie_embeddings",
    # multi-head latent attention's sizes and the rotation's layout (DeepSeek-V3), partial rotary dims (GLM-4.5)
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_interleave",
    "partial_rotary_factor",
    # DeepSeek-V3's routing: the weights would no longer be the model's
    "expert_groups",
    "expert_groups_per_token",
    "routed_scaling_factor",
    "shared_expert_gated",
)


def config_for_init(init_from: str, preset: str, overrides: dict | None) -> ModelConfig:
    """The run's model config: the source's architecture, the preset's (or overridden) seq_len, the overrides."""
    source = source_config(init_from)
    overrides = typed_overrides(dict(overrides or {}))
    for field in ARCHITECTURE:
        theirs = getattr(source, field)
        if field in overrides and overrides[field] != theirs:
            raise MTNLGError(
                f"model_overrides {field}={overrides[field]} conflicts with {init_from} ({field}={theirs}); "
                f"with init_from the architecture comes from the source"
            )
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise MTNLGError(f"unknown model config field(s) {unknown}; valid fields: {sorted(known)}")
    origin = "model_overrides" if "seq_len" in overrides else f"preset {preset!r}"
    seq_len = overrides.pop("seq_len", PRESETS.get(preset, {}).get("seq_len", source.seq_len))
    if seq_len > source.max_position_embeddings:
        raise MTNLGError(
            f"seq_len {seq_len} ({origin}) is above the {source.max_position_embeddings} positions of "
            f"{init_from}; set model.model_overrides '{{seq_len: {source.max_position_embeddings}}}' or less"
        )
    values = {**dataclasses.asdict(source), "seq_len": seq_len, "init_std": None, **overrides, "name": preset}
    return ModelConfig(**values)


def load_init_weights(model, init_from: str) -> None:
    """Copy the source's model-space weights into the freshly built, not yet sharded `model` (a Hugging Face
    directory's multi-token prediction layers too where the model has such depths)."""
    load_model_space(model, read_source(init_from, mtp_layers=model.config.mtp_layers).weights)
