"""Multi-token prediction as an extension: the depths' weighted loss joins each micro-batch's loss
(`mtp.MultiTokenPredictionLoss`), and the step's MTP loss (unweighted, the mean over depths) and main loss are logged
as `mtp_loss` and `main_loss` beside train_loss (their weighted sum, with any router losses)."""

from __future__ import annotations

from torch import nn

from mtnlg_lightning.mtp import MultiTokenPredictionLoss
from mtnlg_lightning.train.extensions.extension import Extension


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
        for name, value in self.losses.step_means().items():
            module.log(name, value, sync_dist=True)

    def before_step(self, module) -> None:
        self.losses.reset_step()
