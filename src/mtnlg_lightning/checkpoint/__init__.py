"""Checkpoints: one layout-independent, crash-safe format (save, load, manifest, consolidation, preemption)."""

from mtnlg_lightning.checkpoint.callback import ModelCheckpoint
from mtnlg_lightning.checkpoint.model_state import ModelState, read_model_state

__all__ = ["ModelCheckpoint", "ModelState", "read_model_state"]
