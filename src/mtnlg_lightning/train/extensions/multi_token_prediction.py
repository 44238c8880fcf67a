"""Multi-token prediction as an extension: the depths' weighted loss joins each micro-batch's loss
(`mtp.MultiTokenPredictionLoss`), and the step's MTP loss (unweighted, the mean over depths) and main loss are logged
as `mtp_loss` and `main_loss` beside train_loss (their weighted sum, with any router losses)."""

from __future__ import annotations

import torch
from torch import nn

from mtnlg_lightning.mtp import MultiTokenPredictionLoss
from mtnlg_lightning.train.extensions.extension import Extension

LOGGED = ("main_loss", "mtp_loss")  # `MultiTokenPredictionLoss.last`'s names


class MultiTokenPredictionLosses(Extension):
    def __init__(self, config):
        self.config = config
        self.model: nn.Module | None = None  # the model whose forward ran the depths (`MultiTokenPredictionLoss`)
        self.losses: MultiTokenPredictionLoss | None = None

    def on_model(self, model: nn.Module) -> None:
        self.model = model

    def wrap_loss(self, loss_fn):
        self.losses = MultiTokenPredictionLoss(loss_fn, self, self.config)
        return self.losses

    def log_step(self, module) -> None:
        # averaged over the ranks as train_loss is: the same values in any layout
        for name, value in self._step_values(module).items():
            module.log(name, value, sync_dist=True)

    def _step_values(self, module) -> dict[str, torch.Tensor]:
        """The step's means (`MultiTokenPredictionLoss.step_means`); under pipeline parallelism the last stage's,
        which computed them, on every rank of the pipeline (each rank logs, as sync_dist has every rank take part)."""
        means = self.losses.step_means()
        pipeline = getattr(module.runner, "pipeline", None)
        if pipeline is None:
            return means
        held = torch.zeros(len(LOGGED), device=module.device)
        if pipeline.is_last:
            held = torch.stack([torch.as_tensor(means.get(name, 0.0)).float().to(module.device) for name in LOGGED])
        return dict(zip(LOGGED, pipeline.from_last_stage(held), strict=True))

    def before_step(self, module) -> None:
        self.losses.reset_step()
