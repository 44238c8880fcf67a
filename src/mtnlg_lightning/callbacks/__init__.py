"""Training callbacks: loss-spike detection (log / skip / rewind) and activation checkpointing."""

from mtnlg_lightning.callbacks.activation_checkpointing import (
    ActivationCheckpointing,
    apply_activation_checkpointing,
    checkpointed_modules,
)
from mtnlg_lightning.callbacks.loss_spike import LossSpikeDetection, LossSpikeError, SpikeDetector

__all__ = [
    "ActivationCheckpointing",
    "LossSpikeDetection",
    "LossSpikeError",
    "SpikeDetector",
    "apply_activation_checkpointing",
    "checkpointed_modules",
]
