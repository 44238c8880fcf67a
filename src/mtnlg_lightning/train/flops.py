"""Model FLOPs per iteration (Megatron's formula), achieved TFLOP/s and MFU."""

from __future__ import annotations

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.planning.gpus import ALIASES, GPUS

# Dense bf16 tensor-core peaks (FLOP/s) from the planner's GPU table (gpus.py), under its names and aliases.
PEAK_BF16_FLOPS = {name: spec.peak_tflops * 1e12 for name, spec in GPUS.items()} | {
    alias: GPUS[name].peak_tflops * 1e12 for alias, name in ALIASES.items()
}


def flops_per_iteration(
    config: ModelConfig, batch_size: int, seq_len: int | None = None, recompute: bool = False
) -> float:
    """72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) (Narayanan et al. 2021); 96 instead of 72 with full recompute."""
    s = seq_len or config.seq_len
    h, L, V = config.hidden_size, config.num_layers, config.padded_vocab_size()
    factor = 96 if recompute else 72
    return factor * batch_size * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def peak_flops_for(device_name: str | None, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s per device: an explicit figure wins, else matched from the device name, else unknown."""
    if override_tflops:
        return override_tflops * 1e12
    if not device_name:
        return None
    name = device_name.lower().replace(" ", "-")
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None
