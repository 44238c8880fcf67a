"""MT-NLG's optimizer: AdamW (beta2 = 0.95) with weight decay on weight matrices and embeddings only.

Its own file so the module (which builds it) and the checkpoint reader (which rebuilds its state dict in the same
parameter order) both depend on it, not on each other.
"""

from __future__ import annotations

import torch


def decay_groups(model: torch.nn.Module) -> tuple[list, list]:
    """AdamW's two groups, in parameter order: weight matrices and embeddings decay; biases and LayerNorms not."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return decay, no_decay


def build_adamw(
    model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float, fused: bool | None
) -> torch.optim.AdamW:
    """The optimizer every strategy uses (ZeRO receives it as its client optimizer)."""
    decay, no_decay = decay_groups(model)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)
