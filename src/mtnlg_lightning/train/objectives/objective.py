"""What a run trains the model to do: an `Objective` owns its step, its loss in every layout, its metrics, the data
it needs and what it adds to a checkpoint. `MTNLGModule` asks its objective and never tests which one it holds.

An objective reaches the layout only through the module's parts that every objective shares: `module.runner`
(`forward_backward` / `evaluate` over micro-batches in one process, TP, PP, CP or ZeRO: `train/step_interfaces.py`),
`module.loss_fn` (the layout's per-micro-batch token loss, with the extensions' terms: vocabulary-parallel under TP,
the last stage's under PP, a chunk's under CP) and `module.trainer.strategy.reduce`. A new objective is one module
beside this one and its line in `OBJECTIVES` (`train/objectives/__init__.py`); its settings are the module's
hyperparameters it reads in `from_hparams`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from mtnlg_lightning.data.packing import PADDING_DOCUMENT, ROW_LENGTHS
from mtnlg_lightning.errors import MTNLGError


class Objective:
    """The defaults are those of an objective with no state beyond the model: override what differs."""

    name: ClassVar[str]
    # what a sample of the data is (`served` by the data module): "sequences" (token rows: pretraining, SFT, packed
    # or not) or "pairs" (a chosen and a rejected answer); what the data module serves must be what this expects
    data_kind: ClassVar[str] = "sequences"
    data_hint: ClassVar[str] = "the pretraining or fine-tuning data modules"  # where such data comes from
    # sequences the model sees per sample (tokens per second and FLOPs count them): a pair is 2
    sequences_per_sample: ClassVar[int] = 1
    # steps in a row that train on each global batch the data serves (GRPO's num_iterations)
    batch_repeats: ClassVar[int] = 1

    @classmethod
    def from_hparams(cls, hparams: Mapping) -> Objective:
        """This objective with the settings it reads from the module's hyperparameters (checked: one line each)."""
        return cls()

    def check_data(self, datamodule) -> None:
        """One line unless the run's data serves what this objective trains on."""
        served = getattr(datamodule, "served", "sequences")
        if served != self.data_kind:
            hint = getattr(datamodule, "objective_hint", None) or f"use {self.data_hint}"
            raise MTNLGError(
                f"model.objective {self.name} trains on {self.data_kind}; the data serves {served}: {hint}"
            )

    def check_layout(self, module, strategy) -> None:
        """One line unless this objective can train in the strategy's layout (before the layout is applied)."""

    def on_layout_applied(self, module) -> None:
        """The model is this rank's part of the layout, before a checkpoint is restored into it."""

    def on_fit_start(self, module) -> None:
        """Before the first step of a run, after a checkpoint is restored (the 3D strategy's) or before it is
        (Lightning's strategies restore the weights after this)."""

    def forward_backward(self, module, batch: dict) -> torch.Tensor:
        """The step's forward and backward over this rank's micro-batches; the step's loss (the logged value)."""
        raise NotImplementedError

    def evaluate(self, module, batch: dict) -> torch.Tensor:
        """The batch's loss, forward only."""
        raise NotImplementedError

    def samples_in(self, batch: dict) -> int:
        """The samples a batch holds (the logged values' batch size)."""
        return len(batch["labels"])

    def computed_rows(self, batch: dict) -> dict:
        """The rows this rank's last step ran through the model, in micro-batches of `micro_batch_size x
        sequences_per_sample` rows: the step's tokens, positions and FLOPs are counted from them."""
        return batch

    def document_tokens(self, rows: dict) -> int:
        """The documents' tokens of `computed_rows` (what `tokens_per_sec` counts, the padding not): their
        ROW_LENGTHS, else their non-padding `document_ids`, else every position."""
        if rows.get(ROW_LENGTHS) is not None:
            return int(rows[ROW_LENGTHS].sum())
        if rows.get("document_ids") is not None:
            return int((rows["document_ids"] != PADDING_DOCUMENT).sum())
        return rows["input_ids"].numel()

    def log_metrics(self, module, prefix: str = "") -> None:
        """After the step (`prefix` "") or a validation batch (`val_`): this objective's own metrics."""

    def state_dict(self, module) -> dict:
        """Entries this objective adds to a checkpoint (tensors or plain values)."""
        return {}

    def load_state_dict(self, module, checkpoint: dict) -> None:
        """Read back what `state_dict` saved, on a resume."""
