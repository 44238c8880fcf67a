"""A callback the fault drill (`benchmarks/fault_drill.py`) and `tests/test_resilience.py` add to `mtnlg fit` from
the command line: each rank records its pid, its finished steps and the evaluations it is in (so a drill knows whom
to stop, and when), one rank can be slowed before every step (a straggler), and every validation batch can be
slowed (a window to strike during an evaluation)."""

import os
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class Probe(Callback):
    def __init__(self, dir: str, slow_rank: int = -1, slow_s: float = 0.0, slow_eval_s: float = 0.0):
        self.dir, self.slow_rank, self.slow_s, self.slow_eval_s = Path(dir), slow_rank, slow_s, slow_eval_s

    def on_train_start(self, trainer, pl_module):
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"rank{trainer.global_rank}.pid").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.slow_rank:
            time.sleep(self.slow_s)  # before the forward: what StragglerMonitor measures

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._append(trainer, "steps", trainer.global_step)

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._append(trainer, "evals", trainer.global_step)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        time.sleep(self.slow_eval_s)

    def _append(self, trainer, what: str, step: int) -> None:
        with open(self.dir / f"rank{trainer.global_rank}.{what}", "a") as handle:
            handle.write(f"{os.getpid()} {step}\n")
