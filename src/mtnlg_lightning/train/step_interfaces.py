"""The parts of a training step that a strategy supplies, and the one path the module (`MTNLGModule`) runs them by.

Every step, in every layout: `runner.forward_backward(batch, micro_batch_size, step_loss)` accumulates the
gradients of this rank's micro-batches, `runner.update(optimizer, max_norm, undoable)` reduces and clips them and
returns an `Update` holding the pre-clip norm; the module asks the callbacks that may veto (`UpdateVeto`) with that
norm and hands their answer down: `update.finish(vetoed)` applies or discards. The runner is the 3D strategy
itself, or `LocalRunner` under Lightning's own strategies (one device, DDP), chosen once when the module is set up.
A runner's `row_multiple` says what its layout lets a micro-batch's width be: a multiple of it (rows that give their
lengths are cut to their longest), or None where the rows keep seq_len (`RowWidths`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Protocol, runtime_checkable

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from mtnlg_lightning.data.packing import GROUP_LENGTHS, ROW_LENGTHS, ROW_MULTIPLE
from mtnlg_lightning.model import MODEL_INPUTS
from mtnlg_lightning.parallel.output_layer import heads_in_loss

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# What the data gives a micro-batch (data/datamodule.py): always input_ids and labels; position_ids and, for packed
# rows, document_ids when present (MODEL_INPUTS, passed to the model by name).
BATCH_FIELDS = ("input_ids", "labels")


def trimmed_width(lengths: torch.Tensor | None, width: int, row_multiple: int | None) -> int:
    """The positions a micro-batch is computed over: its longest row (`lengths`, the positions before each row's
    padding) rounded up to `row_multiple`, at most `width` (the rows as served). `width` itself where the batch does
    not give its rows' lengths or the layout keeps seq_len (`row_multiple` None: `RowWidths`)."""
    if lengths is None or row_multiple is None:
        return width
    return min(width, -(-int(lengths.max()) // row_multiple) * row_multiple)


class RowWidths:
    """How wide a layout computes a micro-batch of rows that give their lengths (`micro_batches_of`): up to its longest
    row, rounded up to ROW_MULTIPLE and to the cuts of sequence and context parallelism (`sequence_multiple`); or
    seq_len where the layout needs it, which the log says once: a pipeline's schedule sends seq_len-wide activations
    between its stages, and a mixture of experts' router losses and balancing count every position, padding too, so
    rows cut in one layout and whole in another would route other tokens."""

    def __init__(self):
        self.said = False

    @staticmethod
    def why_fixed(config, pipeline: bool) -> str | None:
        if pipeline:
            return "pipeline parallelism runs fixed shapes"
        if config.moe:
            return "a mixture of experts routes the padding too (its router losses count every position)"
        return None

    def multiple(self, config, pipeline: bool = False, sequence_multiple: int = 1) -> int | None:
        return None if self.why_fixed(config, pipeline) else math.lcm(ROW_MULTIPLE, sequence_multiple)

    def note(self, batch: dict, config, pipeline: bool = False) -> None:
        """Say once why rows that could be cut keep seq_len."""
        why = self.why_fixed(config, pipeline)
        if why is None or self.said or batch.get(ROW_LENGTHS) is None:
            return
        self.said = True
        rank_zero_info(
            f"{why}: each row is padded to seq_len {batch['input_ids'].shape[1]}, not to its micro-batch's longest "
            "row (pack the data to spend fewer positions on padding)"
        )


def micro_batches_of(batch: dict, micro_batch_size: int, row_multiple: int | None = None):
    """(input_ids, labels, model_inputs) of each micro-batch of a rank's batch; model_inputs: the keyword inputs of
    the model the batch carries (position_ids, document_ids), split alike. Rows that say their lengths (ROW_LENGTHS:
    padding only at their ends, nothing trained there) are grouped longest first and each micro-batch is cut to
    `trimmed_width` (`grouped_by_length`)."""
    batch = grouped_by_length(batch, row_multiple)
    names = [name for name in MODEL_INPUTS if batch.get(name) is not None]
    fields = [batch[field].split(micro_batch_size) for field in (*BATCH_FIELDS, *names)]
    lengths = _row_lengths(batch, micro_batch_size)
    for (input_ids, labels, *inputs), rows in zip(zip(*fields, strict=True), lengths, strict=True):
        served = input_ids.shape[1]
        width = trimmed_width(rows, served, row_multiple)
        if width < served:
            input_ids, *inputs = (field[:, :width].contiguous() for field in (input_ids, *inputs))
            # columns past the inputs' (an objective's row index, DPO's and GRPO's targets) are not positions: kept
            labels = torch.cat([labels[:, :width], labels[:, served:]], dim=1)
        yield input_ids, labels, dict(zip(names, inputs, strict=True))


def grouped_by_length(batch: dict, row_multiple: int | None) -> dict:
    """The batch's rows longest first where the layout cuts them (`row_multiple`), so each micro-batch holds rows of
    like lengths and little padding. Nothing else changes: the padding computes nothing that is read (attention is
    causal within each document, the padding's labels are ignored), and the step's loss is the token mean over the
    global batch's labels, whichever micro-batch holds a row. Rows that must stay together and in order (a
    preference pair) say so by a common GROUP_LENGTHS, which the sort then uses (a stable sort keeps them adjacent)."""
    lengths = batch.get(ROW_LENGTHS)
    if lengths is None or row_multiple is None:
        return batch
    order = torch.argsort(batch.get(GROUP_LENGTHS, lengths), descending=True, stable=True)
    moved = (*BATCH_FIELDS, *MODEL_INPUTS, ROW_LENGTHS, GROUP_LENGTHS)
    names = [name for name in moved if batch.get(name) is not None]
    return {**batch, **{name: batch[name][order] for name in names}}


def micro_batch_shapes(batch: dict, micro_batch_size: int, row_multiple: int | None = None) -> list[tuple[int, int]]:
    """(rows, width) of each micro-batch as `micro_batches_of` hands it to the model: what the step computes."""
    batch = grouped_by_length(batch, row_multiple)
    width = batch["input_ids"].shape[1]
    rows = [len(part) for part in batch["input_ids"].split(micro_batch_size)]
    lengths = _row_lengths(batch, micro_batch_size)
    return [(n, trimmed_width(part, width, row_multiple)) for n, part in zip(rows, lengths, strict=True)]


def _row_lengths(batch: dict, micro_batch_size: int) -> list:
    """Each micro-batch's ROW_LENGTHS, or None for each where the batch does not give them."""
    lengths = batch.get(ROW_LENGTHS)
    if lengths is None:
        return [None] * count_micro_batches(batch, micro_batch_size)
    return list(lengths.split(micro_batch_size))


def count_micro_batches(batch: dict, micro_batch_size: int) -> int:
    return -(-len(batch["labels"]) // micro_batch_size)


def accumulate(
    forward: nn.Module,
    backward,
    batch: dict,
    micro_batch_size: int,
    step_loss: LossFn,
    no_sync=None,
    row_multiple: int | None = None,
):
    """Forward and backward every micro-batch, each loss divided by their count (the gradients add up to the step's
    mean); `no_sync` (Lightning's DDP) defers the gradient reduction to the last; `row_multiple`: see
    `micro_batches_of`. Returns the step's loss."""
    micro_batches = count_micro_batches(batch, micro_batch_size)
    total = torch.zeros((), device=batch["labels"].device)
    for i, (input_ids, labels, inputs) in enumerate(micro_batches_of(batch, micro_batch_size, row_multiple)):
        last = i == micro_batches - 1
        with nullcontext() if last or no_sync is None else no_sync():
            loss = step_loss(forward(input_ids, **inputs), labels)
            backward(loss / micro_batches)
        total += loss.detach()
    return total / micro_batches


@torch.no_grad()
def evaluate(
    model: nn.Module, batch: dict, micro_batch_size: int, step_loss: LossFn, row_multiple: int | None = None
) -> torch.Tensor:
    """The batch's loss, forward only."""
    micro = micro_batches_of(batch, micro_batch_size, row_multiple)
    return torch.stack([step_loss(model(i, **inputs), labels) for i, labels, inputs in micro]).mean()


class Update:
    """One step's update, reduced and clipped, waiting for the veto: `grad_norm` is the pre-clip global norm (the
    same on every rank); `finish(vetoed)` applies the update or discards it and leaves the gradients cleared.
    `after` runs once it is finished, applied or not (the last stage's copy of a tied embedding)."""

    def __init__(self, grad_norm: torch.Tensor, apply: Callable[[], None], discard: Callable[[], None], after=None):
        self.grad_norm = grad_norm
        self._apply, self._discard, self._after = apply, discard, after

    def finish(self, vetoed: bool) -> None:
        (self._discard if vetoed else self._apply)()
        if self._after is not None:
            self._after()


def optimizer_update(strategy, optimizer, grad_norm: torch.Tensor, after=None) -> Update:
    """The update of an optimizer that steps after the norm is known (not a fused engine): applied through
    Lightning's precision plugin (which runs the `on_before_optimizer_step` hooks). Lightning's
    `LightningOptimizer.step()` is not used: it would count a step, and the step is counted once, by the module."""

    def apply() -> None:
        strategy.optimizer_step(optimizer, closure=_no_closure)
        optimizer.zero_grad(set_to_none=True)

    def discard() -> None:
        optimizer.zero_grad(set_to_none=True)

    return Update(grad_norm, apply, discard, after)


def _no_closure() -> None:  # the backward already ran: the optimizer step re-evaluates nothing
    return None


class LocalRunner:
    """The step's parts under Lightning's own strategies: one process, or DDP (which reduces the gradients in the
    backward: `block_backward_sync` defers that to the last micro-batch)."""

    def __init__(self, module, strategy):
        self.module, self.strategy = module, strategy
        self.widths = RowWidths()

    @property
    def row_multiple(self) -> int | None:
        return self.widths.multiple(self.module.config)

    def forward_backward(self, batch: dict, micro_batch_size: int, step_loss: LossFn) -> torch.Tensor:
        no_sync = getattr(self.strategy, "block_backward_sync", None)
        model, backward = self.module.model, self.module.manual_backward
        self.widths.note(batch, self.module.config)
        with heads_in_loss(model):
            return accumulate(model, backward, batch, micro_batch_size, step_loss, no_sync, self.row_multiple)

    def evaluate(self, batch: dict, micro_batch_size: int, step_loss: LossFn) -> torch.Tensor:
        self.widths.note(batch, self.module.config)
        with heads_in_loss(self.module.model):
            return evaluate(self.module.model, batch, micro_batch_size, step_loss, self.row_multiple)

    def update(self, optimizer, max_norm: float | None, undoable: bool) -> Update:
        parameters = self.module.model.parameters()
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm else math.inf)
        return optimizer_update(self.strategy, optimizer, grad_norm)


@runtime_checkable
class UpdateVeto(Protocol):
    """A callback that may veto one step's optimizer update (the step still counts).

    Every rank must return the same answer (reduce the signal across the world first)."""

    def should_skip_update(self, trainer, pl_module, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> bool: ...
