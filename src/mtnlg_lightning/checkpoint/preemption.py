"""Preemption: SIGTERM or SIGUSR1 (SLURM's `--signal`) to any rank makes every rank save a complete checkpoint at
the next step boundary and stop cleanly with exit status 75 (`resilience/exit_codes.py`); a job restarted with
`--ckpt_path last` continues from it.

The signal handler only records the signal (no collective, no I/O inside a handler, as Megatron's
`--exit-signal-handler`); the ranks agree on it after each step with one all-reduce of a flag.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from mtnlg_lightning.checkpoint.format import is_checkpoint, read_manifest

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class Preemption(Callback):
    """Added to every `mtnlg fit` by `MTNLGModule.configure_callbacks` (set `model.preemption: false` to leave
    signals to Lightning). `requeue`: after saving on SIGUSR1 under SLURM, rank 0 runs `scontrol requeue`."""

    def __init__(self, signals: tuple[str, ...] = DEFAULT_SIGNALS, requeue: bool = True):
        self.signals = tuple(getattr(signal, name) for name in signals if hasattr(signal, name))
        self.requeue = requeue
        self.received: int | None = None
        self.stopped_at: int | None = None  # the step it saved and stopped at; `mtnlg` then exits 75 (preempted)
        self._previous: dict[int, object] = {}

    def _record(self, signum, frame) -> None:
        self.received = signum

    def on_train_start(self, trainer, pl_module) -> None:
        self.received = None
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for signum in self.signals:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._record)  # replaces Lightning's, which stops without saving

    def on_train_end(self, trainer, pl_module) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            return
        path = self.checkpoint_path(trainer)
        if not (is_checkpoint(path) and read_manifest(path).get("global_step") == trainer.global_step):
            trainer.save_checkpoint(path)
        trainer.should_stop = True
        self.stopped_at = trainer.global_step
        name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
        rank_zero_info(f"preemption ({name}): saved {path} at step {trainer.global_step}; stopping")
        if self.requeue and self.received == getattr(signal, "SIGUSR1", None) and "SLURM_JOB_ID" in os.environ:
            if trainer.is_global_zero:
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)

    @staticmethod
    def checkpoint_path(trainer) -> Path:
        dirpath = None
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, LightningModelCheckpoint) and callback.dirpath:
                dirpath = callback.dirpath
                break
        directory = Path(dirpath) if dirpath else Path(trainer.default_root_dir) / "checkpoints"
        return directory / f"step={trainer.global_step}.ckpt"
