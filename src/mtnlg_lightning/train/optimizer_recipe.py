"""MT-NLG's optimizer: AdamW (beta2 = 0.95) with weight decay on weight matrices and embeddings only.

Its own file so the module (which builds it) and the checkpoint reader (which rebuilds its state dict in the same
parameter order) both depend on it, not on each other.
"""

from __future__ import annotations

import torch

from mtnlg_lightning.moe import moe_layers


def decay_groups(model: torch.nn.Module) -> list[list]:
    """AdamW's groups, in parameter order: weight matrices and embeddings decay; biases and LayerNorms not; a
    mixture of experts' stacked experts decay in a group of their own (ZeRO reduces and partitions them over the
    ranks holding the same experts under expert parallelism; the groups are the same in every layout, so a
    checkpoint's optimizer fits any). Only parameters that train (a LoRA run's frozen base has no optimizer state),
    and only non-empty groups (LoRA's adapters are all matrices; DeepSpeed drops an empty group, which the LR
    scheduler would still count)."""
    experts = {id(p) for _, layer in moe_layers(model) for p in layer.experts.parameters()}
    decay, no_decay, stacked = [], [], []
    for param in model.parameters():
        if param.requires_grad:
            (stacked if id(param) in experts else decay if param.ndim >= 2 else no_decay).append(param)
    return [group for group in (decay, no_decay, stacked) if group]


def build_adamw(
    model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float, fused: bool | None
) -> torch.optim.AdamW:
    """The optimizer every strategy uses (ZeRO receives it as its client optimizer)."""
    groups = [
        {"params": params, "weight_decay": weight_decay if params[0].ndim >= 2 else 0.0}
        for params in decay_groups(model)
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)
