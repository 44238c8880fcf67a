"""What a model family or a config adds to the training step: an `Extension` supplies its model transform, its loss
terms, its after-update hook, its metrics and its checkpoint state through the hooks below; `MTNLGModule`, the 3D
strategy and the checkpoint writers iterate over the module's extensions and never test which ones they hold.

The two today: mixture of experts (`mixture_of_experts.RouterBalancing`: the router's auxiliary and z losses, the
tokens-per-expert logs, the balancing bias moved after each applied update) and LoRA (`adapters.LowRankAdapters`:
the adapters put on the frozen base, the base named and checked in checkpoints, adapter-only state).
"""

from __future__ import annotations

from torch import nn


class Extension:
    """The defaults change nothing: override what the extension needs."""

    # the run trains adapters over a frozen base: the model's buffers, as its frozen weights, are the base's
    # (checkpoints store neither, and nothing may update them)
    frozen_base: bool = False

    def model_transforms(self) -> dict:
        """Keyword arguments of `parallel.parallelize.parallelize_gpt`: the transforms applied with the layout."""
        return {}

    def wrap_loss(self, loss_fn):
        """The micro-batch loss with this extension's terms added (`loss_fn`: the layout's token loss)."""
        return loss_fn

    def on_model(self, model: nn.Module) -> None:
        """The module's model was built or became this rank's part of the layout."""

    def before_step(self, module) -> None:
        """Before the step's micro-batches."""

    def after_update(self, module, vetoed: bool) -> None:
        """After the step's update was applied (or vetoed: the model must stay as it was); collective calls are
        allowed (every rank runs it)."""

    def log_step(self, module) -> None:
        """The step's metrics (`module.log`); may be collective (every rank runs it)."""

    def manifest_entries(self) -> dict:
        """What a checkpoint's manifest records of this extension (plain values)."""
        return {}

    def on_save_checkpoint(self, module, checkpoint: dict) -> None:
        """Add this extension's entries to a checkpoint being saved."""

    def on_load_checkpoint(self, module, checkpoint: dict) -> None:
        """Read (or check) this extension's entries of a checkpoint being resumed."""
