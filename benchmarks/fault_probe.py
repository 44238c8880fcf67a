"""A callback the fault drill (`benchmarks/fault_drill.py`) and `tests/test_resilience.py` add to `mtnlg fit` from
the command line: each rank records its pid and its finished steps (so a drill knows whom to stop, and when), and
one rank can be slowed before every step (a straggler)."""

import os
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class Probe(Callback):
    def __init__(self, dir: str, slow_rank: int = -1, slow_s: float = 0.0):
        self.dir, self.slow_rank, self.slow_s = Path(dir), slow_rank, slow_s

    def on_train_start(self, trainer, pl_module):
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"rank{trainer.global_rank}.pid").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.slow_rank:
            time.sleep(self.slow_s)  # before the forward: what StragglerMonitor measures

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(self.dir / f"rank{trainer.global_rank}.steps", "a") as handle:
            handle.write(f"{os.getpid()} {trainer.global_step}\n")
