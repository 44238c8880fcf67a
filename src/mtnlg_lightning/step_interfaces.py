"""The small interfaces between the training step (owned by `MTNLGModule`), strategies and callbacks.

The module runs the step; a strategy that parallelises the model supplies primitives through these protocols and
never calls back into the module; callbacks take part through two hooks. Each is checked with `isinstance`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@runtime_checkable
class PipelineExecutor(Protocol):
    """A strategy whose pipeline schedule runs the micro-batches (forward and backward interleaved by stage)."""

    @property
    def is_pipelined(self) -> bool: ...

    def run_pipeline(self, tokens: torch.Tensor, micro_batch_size: int, loss_fn: LossFn, train: bool) -> torch.Tensor:
        """This rank's share of one step through the schedule; the mean micro-batch loss on every pipeline rank."""
        ...


@runtime_checkable
class GradientUpdater(Protocol):
    """A strategy that owns the gradient reduction, clipping and optimizer update (a ZeRO engine, DP all-reduce).

    The update is a small transaction so the module can ask callbacks for a veto between its phases:
    `prepare_update` reduces and clips (an engine that fuses reduction, clipping and update in one call, such as
    DeepSpeed's `step()`, applies the update here and keeps an undo when `undoable`), then exactly one of
    `commit_update` or `discard_update` follows."""

    @property
    def forward_module(self) -> nn.Module:
        """What runs a micro-batch forward on this rank (the engine under ZeRO, else the sharded model)."""
        ...

    def prepare_update(self, optimizer, max_norm: float | None, undoable: bool) -> torch.Tensor:
        """Reduce and clip the gradients by the global norm; return the pre-clip norm (same on every rank)."""
        ...

    def commit_update(self, optimizer) -> None: ...

    def discard_update(self, optimizer) -> None: ...


@runtime_checkable
class ModelBuiltHook(Protocol):
    """A callback that transforms the model right after it is built, before any strategy wraps or shards it."""

    def on_model_built(self, trainer, pl_module) -> None: ...


@runtime_checkable
class UpdateVeto(Protocol):
    """A callback that may veto one step's optimizer update (the step still counts).

    Every rank must return the same answer (reduce the signal across the world first)."""

    def should_skip_update(self, trainer, pl_module, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool: ...
