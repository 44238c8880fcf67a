"""The `ActivationCheckpointing` callback: configs that name it keep working.

Activation checkpointing is a model transform (`parallel/activation_checkpointing.py`), applied with the layout
(`parallel.parallelize.parallelize_gpt`) and configured by the module's `activation_checkpointing` key; this
callback only sets that key from its own arguments.
"""

from __future__ import annotations

from lightning.pytorch import Callback
from torch import nn

from mtnlg_lightning.parallel.activation_checkpointing import (
    Mode,
    Recompute,
    apply_activation_checkpointing,
    checkpointed_modules,
)

__all__ = ["ActivationCheckpointing", "apply_activation_checkpointing", "checkpointed_modules"]


class ActivationCheckpointing(Callback):
    """Recompute activations in the backward pass instead of keeping them; the same as the module's
    `activation_checkpointing: MODE` (and `activation_checkpointing_every_n`), which this sets.

    Args:
        mode: ``full`` (every block), ``selective`` (attention core only, Megatron), ``every_n`` (blocks 0, n, 2n...)
            or ``none``.
        every_n: the n of ``every_n``.
    """

    def __init__(self, mode: Mode = "selective", every_n: int = 2):
        self.recompute = Recompute(mode, every_n)
        self.mode, self.every_n = mode, every_n
        self.applied: list[str] = []

    def apply(self, model: nn.Module) -> list[str]:
        self.applied = self.recompute.apply(model)
        return self.applied

    def setup(self, trainer, pl_module, stage: str) -> None:
        model = getattr(pl_module, "model", None)
        if hasattr(pl_module, "recompute"):  # before the model is built: the transform applies it
            pl_module.recompute = self.recompute
        elif isinstance(model, nn.Module):  # a module of another kind whose model already exists
            self.apply(model)

    def on_fit_start(self, trainer, pl_module) -> None:
        model = getattr(pl_module, "model", None)
        if isinstance(model, nn.Module):
            self.applied = checkpointed_modules(model)
