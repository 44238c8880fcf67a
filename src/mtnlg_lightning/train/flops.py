"""Model FLOPs per token and per iteration of any block (GPT, Llama, Qwen), achieved TFLOP/s and MFU."""

from __future__ import annotations

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.families import matmul_parameters
from mtnlg_lightning.gpus import ALIASES, GPUS

# Dense bf16 tensor-core peaks (FLOP/s) from the planner's GPU table (gpus.py), under its names and aliases.
PEAK_BF16_FLOPS = {name: spec.peak_tflops * 1e12 for name, spec in GPUS.items()} | {
    alias: GPUS[name].peak_tflops * 1e12 for alias, name in ALIASES.items()
}


def forward_flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """2 FLOPs per matmul weight (`families.matmul_parameters`: every block's Linear layers and the LM head), plus
    attention's QK^T and AV over the whole sequence (2 x 2 x S x heads x head_dim per layer, counted without the
    causal half as Megatron and PaLM count it); the multi-token prediction depths' blocks as layers."""
    s = seq_len or config.seq_len
    attention = 4 * s * config.num_heads * config.head_dim * (config.num_layers + config.mtp_layers)
    return 2 * matmul_parameters(config) + attention


def head_flops_per_token(config: ModelConfig) -> float:
    """The LM head's part of `forward_flops_per_token` (2 per weight of its [vocabulary x hidden] matrix): in a
    training step the loss applies the head only where a label counts (`parallel/output_layer.py`), so a step's model
    FLOPs leave it out at the other positions (prompts, padding)."""
    return 2 * config.hidden_size * config.padded_vocab_size()


def flops_per_iteration(
    config: ModelConfig, batch_size: int, seq_len: int | None = None, recompute: bool = False
) -> float:
    """Model FLOPs of one training step: 3 forwards' worth (forward + backward), 4 with full recompute. For the GPT
    block this is Megatron's 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) (Narayanan et al. 2021; 96 with recompute)."""
    s = seq_len or config.seq_len
    return (4 if recompute else 3) * batch_size * s * forward_flops_per_token(config, s)


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
