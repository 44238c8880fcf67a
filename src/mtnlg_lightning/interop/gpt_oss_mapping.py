"""Model-space weights <-> Hugging Face `GptOssForCausalLM` (`model_type` gpt_oss), both ways, exactly, and its
`config.json` <-> `ModelConfig`.

The attention, norms, router and embeddings move by name as `llama_mapping` moves them (biases included). Three
tensors differ in layout:
- `self_attn.sinks` [heads] is a parameter of the attention there, `attn.sinks.weight` here;
- `mlp.experts.gate_up_proj` [E, H, 2I] (input-major, `x @ W`, gate and up interleaved column by column: gate the
  even columns, up the odd ones) and its bias [E, 2I] are our `experts.gate` and `experts.up` [E, I, H] (+ [E, I]);
- `mlp.experts.down_proj` [E, I, H] (+ bias [E, H]) is our `experts.down` [E, H, I] transposed.
Reading takes the even and odd columns and transposes; writing interleaves them back, experts at a time.

MXFP4-quantised checkpoints (as published: `quantization_config.quant_method` mxfp4) store the two expert matrices
as `*_blocks` (uint8 [E, rows, G, 16], two E2M1 codes per byte, the low nibble first) and `*_scales` (uint8
[E, rows, G], an E8M0 exponent biased by 127), rows being the output features: they are dequantised on import as
transformers does (`integrations/mxfp4.py`): w = LUT[code] * 2^(scale - 127), each group of 32 inputs one scale. The
values are exact in fp32 (and bf16). The rest of such a file is unquantised. An export writes unquantised weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtnlg_lightning.checkpoint.safetensors_shards import TensorSpec
from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.family_specs import GPT_OSS
from mtnlg_lightning.interop import llama_mapping
from mtnlg_lightning.interop.llama_mapping import (  # noqa: F401 - a mapping's interface
    HEAD,
    hf_block_fields,
    is_constant,
    normalize,
)

MODEL_TYPES = (GPT_OSS.hf_model_type,)
_LAYER = "model.layers.{i}."


def read_config(cfg: dict, path: Path) -> ModelConfig:
    """The architecture of a GPT-OSS `config.json`; what this decoder does not have is one line."""
    where = path / "config.json"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        value = cfg.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise MTNLGError(f"{where}: {key} is {value!r}, expected an integer >= 1")
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if cfg.get("quantization_config") and method != "mxfp4":
        raise MTNLGError(
            f"{path} holds {method or 'quantised'} weights; only MXFP4 experts are dequantised on import: "
            f"dequantise them with transformers first and read that directory"
        )
    if cfg.get("attention_bias") is False:
        raise MTNLGError(f"{path}: a gpt_oss model without attention biases cannot be imported")
    theta, scaling = llama_mapping._rope(cfg, where)
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]  # transformers' default: alternating from a sliding layer 0
    sliding = "sliding_attention" in types
    positions = cfg.get("max_position_embeddings") or 131_072
    coef = cfg.get("router_aux_loss_coef", 0.0) if cfg.get("output_router_logits") else 0.0
    return ModelConfig(
        num_layers=layers,
        **hf_block_fields(cfg, heads, positions, 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layer_types=list(types),
        sliding_window=cfg.get("sliding_window") if sliding else None,
        num_experts=cfg.get("num_local_experts"),
        experts_per_token=cfg.get("num_experts_per_tok"),
        moe_ffn_hidden_size=cfg["intermediate_size"],
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        router_aux_loss_coef=float(coef),
        name=cfg.get("_name_or_path") or path.name,
        family=GPT_OSS.name,
    )


def hf_config(transformers, config: ModelConfig, vocab: int, eod_id: int | None, dtype: str):
    """The transformers `GptOssConfig` of `config`."""
    rope = {"rope_type": "default", "rope_theta": config.rope_theta, **(config.rope_scaling or {})}
    return transformers.GptOssConfig(
        vocab_size=vocab,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.layernorm_eps,
        initializer_range=config.init_std,
        attention_dropout=config.attention_dropout,
        rope_parameters=rope,
        layer_types=list(config.layer_types or ["full_attention"] * config.num_layers),
        sliding_window=config.sliding_window or config.max_position_embeddings,
        num_local_experts=config.num_experts,
        num_experts_per_tok=config.experts_per_token,
        swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=config.swiglu_limit,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=config.router_aux_loss_coef > 0,
        attention_bias=True,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        architectures=[GPT_OSS.hf_architecture],
        dtype=dtype,
    )


# ------------------------------------------------------------------------------------------------ tensors
def _special(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Our tensors whose Hugging Face form is another layout: the sinks and the experts."""
    out = {}
    for i in range(config.num_layers):
        layer, experts = _LAYER.format(i=i), f"{_LAYER.format(i=i)}mlp.experts."
        out[f"blocks.{i}.attn.sinks.weight"] = (f"{layer}self_attn.sinks",)
        for ours in ("gate", "up"):
            out[f"blocks.{i}.mlp.experts.{ours}.weight"] = (f"{experts}gate_up_proj",)
            out[f"blocks.{i}.mlp.experts.{ours}.bias"] = (f"{experts}gate_up_proj_bias",)
        out[f"blocks.{i}.mlp.experts.down.weight"] = (f"{experts}down_proj",)
        out[f"blocks.{i}.mlp.experts.down.bias"] = (f"{experts}down_proj_bias",)
    return out


def sources(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each model-space tensor of `config` and the Hugging Face tensor(s) it is made of (gate and up both read
    gate_up_proj)."""
    return {**llama_mapping.sources(config), **_special(config)}


# E2M1 (fp4) codes -> values, transformers' FP4_VALUES: codes 8-15 are the negatives of 0-7.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_SUFFIXES = ("_blocks", "_scales")


def sources_in(config: ModelConfig, names) -> dict[str, tuple[str, ...]]:
    """`sources`, for the tensor `names` a directory holds: an MXFP4 file's experts are made of their blocks and
    scales instead."""
    found, out = set(names), sources(config)
    for ours, theirs in out.items():
        packed = tuple(theirs[0] + suffix for suffix in MXFP4_SUFFIXES)
        if _part(ours) and ours.endswith(".weight") and theirs[0] not in found and packed[0] in found:
            out[ours] = packed
    return out


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, G, 16] uint8 codes and [..., rows, G] uint8 exponents -> [..., rows, G x 32] fp32 (transformers'
    `convert_moe_packed_tensors` before its transpose)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8).to(torch.int64)
    values = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1).flatten(-2)  # low nibble first
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32)).flatten(-2)


def _part(name: str) -> str:
    """gate, up or down for an expert tensor; '' otherwise."""
    return name.split("mlp.experts.")[1].split(".")[0] if "mlp.experts." in name else ""


def from_hf(name: str, tensors: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    part = _part(name)
    if not part:
        return llama_mapping.from_hf(name, tensors, config)
    if len(tensors) == 2:  # MXFP4 blocks and scales: dequantised, already [E, out rows, in] (ours' orientation)
        tensor = dequantize_mxfp4(*tensors)
        return (tensor[:, 0::2] if part == "gate" else tensor[:, 1::2] if part == "up" else tensor).contiguous()
    (tensor,) = tensors
    if part in ("gate", "up"):  # the even (gate) or odd (up) columns of [E, H, 2I] / [E, 2I]
        tensor = tensor[..., 0::2] if part == "gate" else tensor[..., 1::2]
    if name.endswith(".weight"):  # [E, in, out] -> [E, out, in]
        tensor = tensor.transpose(1, 2)
    return tensor.contiguous()


def ours_shape(name: str, shapes: list[tuple[int, ...]], config: ModelConfig) -> tuple[int, ...]:
    part = _part(name)
    if not part:
        return llama_mapping.ours_shape(name, shapes, config)
    if len(shapes) == 2:  # MXFP4 blocks [E, rows, G, 16]: rows x (G x 32) inputs, gate and up the even / odd rows
        e, rows, groups, width = shapes[0]
        return (e, rows // 2 if part in ("gate", "up") else rows, groups * width * 2)
    shape = list(shapes[0])
    if part in ("gate", "up"):
        shape[-1] //= 2
    if name.endswith(".weight"):
        shape[1], shape[2] = shape[2], shape[1]
    return tuple(shape)


def tensor_specs(weights, config: ModelConfig, vocab: int, dtype: torch.dtype) -> list[TensorSpec]:
    """The Hugging Face tensors: llama_mapping's for those that move by name, then each layer's sinks and experts
    (gate and up interleaved back into gate_up_proj, experts at a time)."""
    specs = llama_mapping.tensor_specs(weights, config, vocab, dtype)
    for i in range(config.num_layers):
        layer, experts, ours = _LAYER.format(i=i), f"{_LAYER.format(i=i)}mlp.experts.", f"blocks.{i}."
        sinks = f"{ours}attn.sinks.weight"
        specs.append(TensorSpec(f"{layer}self_attn.sinks", weights.shape(sinks), dtype, _rows(weights, sinks)))
        gate, up, down = (f"{ours}mlp.experts.{part}" for part in ("gate", "up", "down"))
        e, width, hidden = weights.shape(f"{gate}.weight")
        specs += [
            TensorSpec(f"{experts}gate_up_proj", (e, hidden, 2 * width), dtype, _interleaved(weights, gate, up, True)),
            TensorSpec(f"{experts}gate_up_proj_bias", (e, 2 * width), dtype, _interleaved(weights, gate, up, False)),
            TensorSpec(f"{experts}down_proj", (e, width, hidden), dtype, _transposed(weights, f"{down}.weight")),
            TensorSpec(f"{experts}down_proj_bias", (e, hidden), dtype, _rows(weights, f"{down}.bias")),
        ]
    return specs


def _rows(weights, name: str):
    shape = weights.shape(name)

    def rows(r0: int, r1: int) -> torch.Tensor:
        return weights.read_box(name, (r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:]))

    return rows


def _transposed(weights, name: str):
    """[E, out, in] here -> [E, in, out] there, experts r0..r1."""
    read = _rows(weights, name)
    return lambda r0, r1: read(r0, r1).transpose(1, 2)


def _interleaved(weights, gate: str, up: str, is_weight: bool):
    """gate and up (experts r0..r1) -> their columns interleaved, gate first: [E, H, 2I] weights, [E, 2I] biases."""
    suffix = ".weight" if is_weight else ".bias"
    read_gate, read_up = _rows(weights, gate + suffix), _rows(weights, up + suffix)

    def rows(r0: int, r1: int) -> torch.Tensor:
        g, u = read_gate(r0, r1), read_up(r0, r1)
        if is_weight:
            g, u = g.transpose(1, 2), u.transpose(1, 2)
        return torch.stack([g, u], dim=-1).flatten(-2)

    return rows
