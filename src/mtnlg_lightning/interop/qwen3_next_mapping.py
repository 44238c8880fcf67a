"""Model-space weights <-> Hugging Face `Qwen3NextForCausalLM` (`model_type` qwen3_next), both ways, exactly, and its
`config.json` <-> `ModelConfig`.

Every tensor moves by name as `llama_mapping` moves them (`family_specs.QWEN3_NEXT`: the experts one tensor per
expert, as transformers writes them; Gated DeltaNet's `in_proj_qkvz` / `in_proj_ba` keep their grouped-by-key-head
layout, which `linear_attention.GatedDeltaNet` reads as it is; its convolution's channels, cat(all q, all k, all v)
in the file, are held grouped by key head, permuted here both ways: `linear_attention.grouped_conv_channels`, so
tensor parallelism's shards are whole heads). The config carries the layer pattern
(`layer_types`: linear_attention / full_attention), Gated DeltaNet's sizes, the partial rotary factor and the
mixture of experts (Qwen's `decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`, the shared expert).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtnlg_lightning.checkpoint.safetensors_shards import TensorSpec
from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.family_specs import QWEN3_NEXT
from mtnlg_lightning.interop import llama_mapping
from mtnlg_lightning.interop.llama_mapping import (  # noqa: F401 - the tensor moves every mapping module offers
    HEAD,
    hf_block_fields,
    is_constant,
    normalize,
    ours_shape,
    sources,
)
from mtnlg_lightning.linear_attention import grouped_conv_channels

MODEL_TYPES = (QWEN3_NEXT.hf_model_type,)
LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
CONV = "attn.conv1d.weight"  # the suffix of our Gated DeltaNet convolution's weight, channels grouped by key head


def conv_order(config: ModelConfig) -> torch.Tensor:
    """Our convolution channels' indices in transformers' order (ours = theirs[order])."""
    return grouped_conv_channels(*(getattr(config, key) for key in LINEAR_KEYS))


def from_hf(name: str, tensors: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    if name.endswith(CONV):
        return tensors[0][conv_order(config)]
    return llama_mapping.from_hf(name, tensors, config)


def tensor_specs(weights, config: ModelConfig, vocab: int, dtype: torch.dtype) -> list[TensorSpec]:
    """llama_mapping's, each convolution's channels put back in transformers' order (read whole: [C, 1, kernel])."""
    back = torch.argsort(conv_order(config)) if config.linear_num_key_heads else None
    theirs = {hf[0]: ours for ours, hf in sources(config).items() if ours.endswith(CONV)}
    specs = llama_mapping.tensor_specs(weights, config, vocab, dtype)
    for i, spec in enumerate(specs):
        if spec.name in theirs:
            specs[i] = TensorSpec(spec.name, spec.shape, spec.dtype, _reordered(weights, theirs[spec.name], back))
    return specs


def _reordered(weights, name: str, order: torch.Tensor):
    shape = weights.shape(name)

    def rows(r0: int, r1: int) -> torch.Tensor:
        return weights.read_box(name, (0,) * len(shape), shape)[order[r0:r1]]

    return rows


def read_config(cfg: dict, path: Path) -> ModelConfig:
    """The architecture of a Qwen3-Next `config.json`; what this decoder does not have is one line."""
    where = path / "config.json"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        value = cfg.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise MTNLGError(f"{where}: {key} is {value!r}, expected an integer >= 1")
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r}")
    if cfg.get("attention_bias"):
        problems.append("attention biases")
    if problems:
        raise MTNLGError(f"{path}: a qwen3_next model with {', '.join(problems)} cannot be imported")
    rope = dict(cfg.get("rope_parameters") or {})
    partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    theta, scaling = llama_mapping._rope({**cfg, "rope_parameters": rope}, where)
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    interval = cfg.get("full_attention_interval") or 4
    types = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)
    ]
    positions = cfg.get("max_position_embeddings") or 32768
    dense = cfg.get("mlp_only_layers") or []
    experts = cfg.get("num_experts") or 0
    coef = cfg.get("router_aux_loss_coef", 0.0) if cfg.get("output_router_logits") else 0.0
    moe = dict(
        num_experts=experts,
        experts_per_token=cfg.get("num_experts_per_tok") or 1,
        moe_ffn_hidden_size=cfg.get("moe_intermediate_size"),
        shared_expert_ffn_hidden_size=cfg.get("shared_expert_intermediate_size") or 0,
        moe_layer_step=cfg.get("decoder_sparse_step") or 1,
        dense_layers=sorted(dense) or None,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        router_aux_loss_coef=float(coef),
    )
    return ModelConfig(
        num_layers=layers,
        **hf_block_fields(cfg, heads, positions, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layer_types=list(types),
        **{key: cfg.get(key) for key in LINEAR_KEYS},
        linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim") or 4,
        **(moe if experts else {}),
        name=cfg.get("_name_or_path") or path.name,
        family=QWEN3_NEXT.name,
    )


def hf_config(transformers, config: ModelConfig, vocab: int, eod_id: int | None, dtype: str):
    """The transformers `Qwen3NextConfig` of `config`."""
    rope = {"rope_type": "default", "rope_theta": config.rope_theta, **(config.rope_scaling or {})}
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    return transformers.Qwen3NextConfig(
        vocab_size=vocab,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.layernorm_eps,
        initializer_range=config.init_std,
        attention_dropout=config.attention_dropout,
        rope_parameters={**rope, "partial_rotary_factor": config.partial_rotary_factor},
        layer_types=list(config.layer_types or ["full_attention"] * config.num_layers),
        **{key: getattr(config, key) for key in LINEAR_KEYS},
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        num_experts=config.num_experts,
        num_experts_per_tok=config.experts_per_token,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        shared_expert_intermediate_size=config.shared_expert_ffn_hidden_size,
        decoder_sparse_step=1,
        mlp_only_layers=dense if config.num_experts else [],
        norm_topk_prob=bool(config.norm_topk_prob),
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=config.router_aux_loss_coef > 0,
        attention_bias=False,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        architectures=[QWEN3_NEXT.hf_architecture],
        dtype=dtype,
    )
