"""Checkpoints: one layout-independent, crash-safe format (save, load, manifest, consolidation, preemption)."""

from mtnlg_lightning.checkpoint.model_state import ModelState, read_model_state

__all__ = ["ModelCheckpoint", "ModelState", "read_model_state"]


def __getattr__(name: str):
    # The callback imports Lightning (~8 s on a 2-core machine); reading a checkpoint (evaluation, export,
    # generation) does not need it, so it is loaded on first use. Configs name it as
    # mtnlg_lightning.checkpoint.ModelCheckpoint, which resolves through here.
    if name == "ModelCheckpoint":
        from mtnlg_lightning.checkpoint.callback import ModelCheckpoint

        return ModelCheckpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
