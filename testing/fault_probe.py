"""A callback the fault drill (`benchmarks/fault_drill.py`) and `tests/test_resilience.py` add to `mtnlg fit` from
the command line: each rank records its pid, its finished steps and the evaluations it is in (so a drill knows whom
to stop, and when), one rank can be slowed before every step (a straggler), and every validation batch can be
slowed (a window to strike during an evaluation).

A drill can also hold a group at a step boundary (`hold`): it writes `DIR/hold` as "STEP PID PID ...", and each of
those processes waits at the start of step STEP (or the first after it) until its launcher stops it (the signal that
`Preemption` records: a node joined) and then goes on to its step and save as it would. A new group (other pids) is
not held. The drill thereby keeps a run from finishing before the node it starts has joined, however long that
node's start-up takes on a loaded machine. The hang watchdog is told the rank is alive while it holds (it is
waiting on purpose, not hung)."""

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
        self._hold(trainer)
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

    def _hold(self, trainer, most_s: float = 1800.0) -> None:
        try:
            step, *pids = (int(x) for x in (self.dir / "hold").read_text().split())
        except (FileNotFoundError, ValueError):
            return
        if os.getpid() not in pids or trainer.global_step < step:
            return
        signalled = [cb for cb in trainer.callbacks if type(cb).__name__ == "Preemption"]
        watchdogs = [cb for cb in trainer.callbacks if type(cb).__name__ == "HangWatchdog"]
        started = time.monotonic()
        while not any(cb.received is not None for cb in signalled) and time.monotonic() - started < most_s:
            for watchdog in watchdogs:
                watchdog.beat()  # alive, waiting on purpose
            time.sleep(0.1)
