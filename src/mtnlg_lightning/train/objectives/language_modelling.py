"""Next-token prediction (`--model.objective lm`, the default): pretraining and supervised fine-tuning. The loss is
the token mean over the global batch's counted labels (`loss.StepLoss`), in any layout and under accumulation."""

from __future__ import annotations

import time

import torch

from mtnlg_lightning.loss import StepLoss, counted_labels
from mtnlg_lightning.train.objectives.objective import Objective
from mtnlg_lightning.train.step_interfaces import count_micro_batches


class LanguageModelling(Objective):
    name = "lm"

    def step_loss(self, module, batch: dict) -> StepLoss:
        """A micro-batch's loss in this step: its token mean weighted by its share of the labels counted over the
        whole global batch (one all-reduce of a count per step)."""
        started = time.perf_counter()
        counted = int(module.trainer.strategy.reduce(counted_labels(batch["labels"]), reduce_op="sum"))
        # Waiting here is waiting for the slowest rank: `StragglerMonitor` leaves it out of this rank's own time.
        module.count_wait_s = time.perf_counter() - started
        micro_batches = count_micro_batches(batch, module.micro_batch_size)
        return StepLoss(module.loss_fn, micro_batches, module.trainer.world_size, counted)

    def forward_backward(self, module, batch: dict) -> torch.Tensor:
        return module.runner.forward_backward(batch, module.micro_batch_size, self.step_loss(module, batch))

    def evaluate(self, module, batch: dict) -> torch.Tensor:
        return module.runner.evaluate(batch, module.micro_batch_size, self.step_loss(module, batch))
