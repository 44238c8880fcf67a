"""Stragglers named: every `every_n_steps` steps, each rank's own time for the step is gathered; the maximum, the
median and the slowest rank go to the logger, and a rank slower than `factor` x the median is reported with its host.

A rank's own time is measured from the end of the previous step to its first backward (data loading, host work,
forward): the part before gradient synchronisation, where the ranks wait for the slowest one and every rank's wall
time becomes the same. The one collective before the forward, the step's count of trained labels, is such a wait
too: the module's `count_wait_s` is left out. On a GPU the measured step is bracketed by
`torch.cuda.synchronize()` (only on measured steps). Forward collectives (tensor parallelism, ZeRO-3 gathers) tie a
rank to its group's slowest member, so a straggler there shows as its group; a pipelined step (no backward hook) is
measured whole.
"""

from __future__ import annotations

import socket
import statistics
import time

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback


class StragglerMonitor(Callback):
    """Added to every `mtnlg fit` (`model.straggler_every_n_steps: 0` leaves it out)."""

    def __init__(self, every_n_steps: int = 50, factor: float = 1.5):
        if every_n_steps < 1 or factor <= 1.0:
            raise ValueError("StragglerMonitor takes every_n_steps >= 1 and factor > 1")
        self.every_n_steps, self.factor = every_n_steps, factor
        self.host = socket.gethostname()
        self._start: float | None = None
        self._ready: float | None = None
        self._measured = False
        self.last_report: dict | None = None

    def _next_is_measured(self, trainer) -> bool:
        return (trainer.global_step + 1) % self.every_n_steps == 0  # global_step = steps completed so far

    def _now(self, device: torch.device) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._measured, self._ready = self._next_is_measured(trainer), None
        if self._measured and self._start is None:  # first step after start-up: no previous end to count from
            self._start = self._now(pl_module.device)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._measured and self._ready is None:
            self._ready = self._now(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._measured and self._start is not None:
            ready = self._ready if self._ready is not None else self._now(pl_module.device)
            waited = getattr(pl_module, "count_wait_s", 0.0)  # a LightningModule of another kind waits for none
            self._report(trainer, pl_module, ready - self._start - waited)
        self._measured = False
        self._start = self._now(pl_module.device) if self._next_is_measured(trainer) else None

    def _report(self, trainer, pl_module, seconds: float) -> None:
        times = self._gather(seconds)
        median = statistics.median(t for t, _ in times)
        slowest = max(range(len(times)), key=lambda r: times[r][0])
        worst, host = times[slowest]
        self.last_report = {"max_s": worst, "median_s": median, "slowest_rank": slowest, "host": host}
        pl_module.log("straggler_max_step_s", worst, rank_zero_only=True)
        pl_module.log("straggler_median_step_s", median, rank_zero_only=True)
        pl_module.log("straggler_slowest_rank", float(slowest), rank_zero_only=True)
        if worst > self.factor * median and trainer.is_global_zero:
            print(
                f"straggler: rank {slowest} on {host} took {worst:.3f} s before its backward at step "
                f"{trainer.global_step}, {worst / median:.1f}x the median {median:.3f} s (factor {self.factor:g})",
                flush=True,
            )

    @staticmethod
    def _gather(seconds: float) -> list[tuple[float, str]]:
        mine = (float(seconds), socket.gethostname())
        if not (dist.is_available() and dist.is_initialized()):
            return [mine]
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out
