"""Activation checkpointing (recomputation) of the GPT blocks: `full`, `selective`, `every_n` or `none`.

A model transform (`parallelize.parallelize_gpt` applies it after the layout's sharding, before compilation),
configured by the module's `activation_checkpointing` (`Recompute`); `callbacks.ActivationCheckpointing` sets it
from a callback entry for the configs that name one. Design notes: docs/callbacks.md (activation checkpointing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.model import Block

Mode = Literal["full", "selective", "every_n", "none"]
MODES = ("full", "selective", "every_n", "none")
_MARK = "_mtnlg_activation_checkpointed"


def _checkpointed_forward(module: nn.Module, *args, **kwargs):
    forward = type(module).forward.__get__(module)
    if not torch.is_grad_enabled():  # nothing will be backpropagated: no point in checkpointing
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_module(module: nn.Module) -> None:
    """Run `module`'s forward under non-reentrant activation checkpointing (idempotent, module tree unchanged).

    A functools.partial (not a closure) so deepcopy and pickle rebind it to the copied module."""
    if getattr(module, _MARK, False):
        return
    module.forward = functools.partial(_checkpointed_forward, module)
    setattr(module, _MARK, True)


def uncheckpoint_module(module: nn.Module) -> None:
    if getattr(module, _MARK, False):
        del module.forward
        delattr(module, _MARK)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks in depth order (a pipeline stage holds only its own)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return [blocks[k] for k in sorted(blocks.keys(), key=int)]
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return list(blocks)
    return [m for m in model.modules() if isinstance(m, Block)]


def _block_index(model: nn.Module, position: int, block: nn.Module) -> int:
    """The global layer number when the ModuleDict keys carry it (pipeline stages keep global names)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        for key, value in blocks.items():
            if value is block:
                return int(key)
    return position


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the submodules that currently run under activation checkpointing."""
    return [name for name, module in model.named_modules() if getattr(module, _MARK, False)]


def apply_activation_checkpointing(model: nn.Module, mode: Mode = "full", every_n: int = 2) -> list[str]:
    """Apply `mode` to a GPT model in place; returns the names of the checkpointed submodules."""
    if mode not in MODES:
        raise MTNLGError(f"unknown activation checkpointing mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "every_n" and every_n < 1:
        raise MTNLGError(f"activation checkpointing every_n must be >= 1, got {every_n}")
    for module in model.modules():
        uncheckpoint_module(module)
    blocks = _blocks(model)
    if mode == "full":
        targets = blocks
    elif mode == "every_n":
        targets = [b for i, b in enumerate(blocks) if _block_index(model, i, b) % every_n == 0]
    elif mode == "selective":
        targets = [b.attn.core for b in blocks if hasattr(b, "attn") and hasattr(b.attn, "core")]
        if blocks and not targets:
            raise MTNLGError("selective activation checkpointing needs blocks with an `attn.core` submodule")
    else:
        targets = []
    for module in targets:
        checkpoint_module(module)
    return checkpointed_modules(model)


@dataclass(frozen=True)
class Recompute:
    """What the backward recomputes instead of keeping: `mode` full (every block), selective (the attention core,
    Megatron's), every_n (blocks 0, n, 2n, ...) or none; `every_n` is the n of every_n."""

    mode: Mode = "none"
    every_n: int = 2

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise MTNLGError(f"unknown activation checkpointing mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.every_n < 1:
            raise MTNLGError(f"activation checkpointing every_n must be >= 1, got {self.every_n}")

    def apply(self, model: nn.Module) -> list[str]:
        return apply_activation_checkpointing(model, self.mode, self.every_n)


NO_RECOMPUTE = Recompute()
