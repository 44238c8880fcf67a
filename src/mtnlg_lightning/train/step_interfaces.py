"""The small interfaces between the training step (owned by `MTNLGModule`), strategies and callbacks.

The module runs the step: forward/backward, then one `update()` (reduce, clip, veto, apply or discard). A strategy
that parallelises the model supplies these primitives through the protocols below and never calls back into the
module; callbacks take part through two hooks. Each is checked with `isinstance`.
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


Veto = Callable[[torch.Tensor], bool]  # given the pre-clip global grad norm: True discards this step's update


@runtime_checkable
class GradientUpdater(Protocol):
    """A strategy that owns the gradient reduction, clipping and optimizer update (a ZeRO engine, DP all-reduce)."""

    @property
    def forward_module(self) -> nn.Module:
        """What runs a micro-batch forward on this rank (the engine under ZeRO, else the sharded model)."""
        ...

    def update(self, optimizer, max_norm: float | None, veto: Veto | None) -> torch.Tensor:
        """The one update of a step, after the backward: reduce the gradients over the data-parallel replicas, clip
        them by the global norm, ask `veto(pre-clip norm)`, then apply the update or discard it, and leave the
        gradients cleared. Returns the pre-clip norm (the same on every rank). Does not count the step: the caller
        does (`training_position.TrainingPosition.step_taken`), applied or vetoed."""
        ...


def apply_unless_vetoed(strategy, optimizer, grad_norm: torch.Tensor, veto: Veto | None) -> None:
    """The end of `update` for optimizers that step after the norm is known (not a fused engine): the update is
    applied through Lightning's precision plugin (which runs the `on_before_optimizer_step` hooks) unless vetoed;
    the gradients are cleared either way. Lightning's `LightningOptimizer.step()` is not used: it would count a
    step, and the step is counted once, by the caller."""
    if veto is None or not veto(grad_norm):
        strategy.optimizer_step(optimizer, closure=_no_closure)
    optimizer.zero_grad(set_to_none=True)


def _no_closure() -> None:  # the backward already ran: the optimizer step re-evaluates nothing
    return None


@runtime_checkable
class ModelBuiltHook(Protocol):
    """A callback that transforms the model right after it is built, before any strategy wraps or shards it."""

    def on_model_built(self, trainer, pl_module) -> None: ...


@runtime_checkable
class UpdateVeto(Protocol):
    """A callback that may veto one step's optimizer update (the step still counts).

    Every rank must return the same answer (reduce the signal across the world first)."""

    def should_skip_update(self, trainer, pl_module, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool: ...
