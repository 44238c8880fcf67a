"""Lightning's `ModelCheckpoint` for this format: `ckpt_path="last"` resumes from the newest *complete* checkpoint
of `dirpath` (or starts fresh with a notice), and `save_last` links instead of writing the bytes twice."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from mtnlg_lightning.checkpoint.commit import newest_complete


class ModelCheckpoint(LightningModelCheckpoint):
    """As Lightning's, with `save_last: link` by default (a link to the newest complete checkpoint, made after it
    is complete). Set `dirpath` so that a restarted job finds the checkpoints of the runs before it.

    Args:
        save_last: `link` (default): `last.ckpt` links the newest complete checkpoint; true: a copy of it as well
            (the bytes twice); false or null: no `last.ckpt`. The other keys are Lightning's ModelCheckpoint's.
    """

    def __init__(self, *args, save_last: bool | str | None = "link", **kwargs):
        super().__init__(*args, save_last=save_last, **kwargs)

    def _find_last_checkpoints(self, trainer) -> set[str]:
        if self.dirpath is None:
            return super()._find_last_checkpoints(trainer)
        newest = newest_complete(Path(self.dirpath))
        if newest is None:
            rank_zero_info(f"ckpt_path=last: no complete checkpoint in {self.dirpath}; starting from scratch")
            return set()
        rank_zero_info(f"ckpt_path=last: resuming from {newest}")
        return {str(newest)}
