"""Lightning's `ModelCheckpoint` for this format: `ckpt_path="last"` resumes from the newest *complete* checkpoint
of `dirpath` (or starts fresh with a notice), `save_last` links instead of writing the bytes twice, and a step that
a preemption has just saved is not saved again."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from mtnlg_lightning.checkpoint.commit import link, newest_complete
from mtnlg_lightning.checkpoint.preemption import Preemption


class ModelCheckpoint(LightningModelCheckpoint):
    """As Lightning's, with `save_last: link` by default (a link to the newest complete checkpoint, made after it
    is complete). Set `dirpath` so that a restarted job finds the checkpoints of the runs before it.

    Args:
        save_last: `link` (default): `last.ckpt` links the newest complete checkpoint; true: a copy of it as well
            (the bytes twice); false or null: no `last.ckpt`. The other keys are Lightning's ModelCheckpoint's.
    """

    def __init__(self, *args, save_last: bool | str | None = "link", **kwargs):
        super().__init__(*args, save_last=save_last, **kwargs)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Lightning runs checkpoint callbacks after the others, so a preemption has just saved this step: saving it
        # again would double the time the ranks still need after the signal (a 530B save takes minutes; torchrun
        # kills the ranks 30 s after a node's join by default). `last.ckpt` links to the preemption's save instead.
        preempted = preemption_save(trainer)
        if preempted is None:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        elif self.save_last and self.dirpath and preempted.parent == Path(self.dirpath):
            last = Path(self.format_checkpoint_name({}, self.CHECKPOINT_NAME_LAST))
            if trainer.is_global_zero:
                link(preempted, last)
            self.last_model_path = str(last)

    def on_train_end(self, trainer, pl_module) -> None:
        if preemption_save(trainer) is None:  # Lightning's end-of-run `last.ckpt` is a full save: not in a preemption
            super().on_train_end(trainer, pl_module)

    def _find_last_checkpoints(self, trainer) -> set[str]:
        if self.dirpath is None:
            return super()._find_last_checkpoints(trainer)
        newest = newest_complete(Path(self.dirpath))
        if newest is None:
            rank_zero_info(f"ckpt_path=last: no complete checkpoint in {self.dirpath}; starting from scratch")
            return set()
        rank_zero_info(f"ckpt_path=last: resuming from {newest}")
        return {str(newest)}


def preemption_save(trainer) -> Path | None:
    """The checkpoint a preemption saved at this step, if one did."""
    for callback in trainer.callbacks:
        if isinstance(callback, Preemption) and callback.stopped_at == trainer.global_step:
            return Preemption.checkpoint_path(trainer)
    return None
