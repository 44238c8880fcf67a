"""YaRN rotary scaling (`rope_scaling: {rope_type: yarn, factor, original_max_position_embeddings, ...}`), as
Hugging Face computes it (`modeling_rope_utils._compute_yarn_parameters`): DeepSeek-V3, Kimi K2 and GPT-OSS stretch
their context with it.

Three parts: the inverse frequencies (the wavelengths longer than the original context interpolated by `factor`,
the short ones kept, a linear ramp between `beta_fast` and `beta_slow` rotations), the attention factor that
multiplies cos and sin (so q.k of the rotary dims is scaled by its square), and, for multi-head latent attention,
the softmax scale's correction `mscale(factor, mscale_all_dim)^2` over every dim (`softmax_scale_correction`).
"""

from __future__ import annotations

import math

import torch


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's Eq. 21: 0.1 x mscale x ln(factor) + 1 (1 for no stretch)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _kind(scaling: dict | None) -> str:
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def yarn_inverse_frequencies(scaling: dict, dim: int, theta: float) -> torch.Tensor:
    """The `dim` / 2 inverse frequencies of a YaRN-scaled rotation of `dim` dims."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength makes `rotations` in the context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    positions = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1 - ramp  # the share of each frequency kept as it is
    return (1.0 / (factor * positions)) * ramp + (1.0 / positions) * extrapolated


def yarn_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (given, or mscale / mscale_all_dim of the
    stretch), 1 for every other rotation."""
    if _kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def softmax_scale_correction(scaling: dict | None) -> float:
    """Multi-head latent attention's softmax scale over 1 / sqrt(q/k head dim) (transformers' `yarn_apply_mscale`,
    DeepSeek's reference): mscale(factor, mscale_all_dim)^2 under a scaled rotation with `mscale_all_dim`, else 1."""
    if _kind(scaling) == "default" or not (scaling or {}).get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
