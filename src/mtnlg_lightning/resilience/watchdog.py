"""Hang detection: the training loop beats a heartbeat; a watchdog thread ends a rank that stops progressing.

Each phase has its own limit (seconds without a heartbeat): `startup` (process start to the end of the first step:
building, loading a checkpoint, the first step), `step`, `save`, `eval`. When a limit passes, the rank prints which
phase stalled and the collective its main thread waits in, dumps every thread's Python stack (faulthandler), and
exits with `ExitCode.HANG` (124) so the launcher restarts the group from the newest checkpoint. A rank that is itself
frozen (SIGSTOP, a dead GPU) cannot do this: its peers, blocked in a collective with it, do it for it.

The process groups' collective timeout follows the same limits (phase limit + COLLECTIVE_MARGIN_S, so the watchdog's
diagnosis comes first and the collective timeout stays a backstop): the startup limit at initialisation, tightened to
the step limit after the first step (as torchtitan does), widened to the save / eval limit for those phases.

Environment variables override the config keys, so an operator can set them in a batch script:
MTNLG_STARTUP_TIMEOUT, MTNLG_STEP_TIMEOUT, MTNLG_SAVE_TIMEOUT, MTNLG_EVAL_TIMEOUT (seconds).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.distributed_c10d import _set_pg_timeout, _world

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.resilience.exit_codes import ExitCode

# Defaults for GPU clusters: MT-NLG's step took ~30-60 s on 4,480 A100s; a 530B checkpoint with Adam state is
# ~8.5 TB, minutes on a parallel file system; start-up includes loading that checkpoint.
DEFAULT_LIMITS = {"startup": 1800.0, "step": 300.0, "save": 1800.0, "eval": 600.0}
ENV_VARS = {phase: f"MTNLG_{phase.upper()}_TIMEOUT" for phase in DEFAULT_LIMITS}
COLLECTIVE_MARGIN_S = 30.0


def resolve_limits(configured: dict[str, float]) -> dict[str, float]:
    """The configured limits with the environment's overrides; bad values are a configuration error."""
    limits = {}
    for phase, value in configured.items():
        raw = os.environ.get(ENV_VARS[phase], "")
        source = ENV_VARS[phase] if raw else f"{phase}_timeout"
        try:
            limits[phase] = float(raw) if raw else float(value)
        except ValueError:
            raise MTNLGError(f"{source} must be a number of seconds, got {raw!r}") from None
        if limits[phase] <= 0:
            raise MTNLGError(f"{source} must be > 0 seconds, got {limits[phase]:g}")
    return limits


def startup_collective_timeout() -> timedelta:
    """The process groups' timeout at initialisation (before any callback is known): the startup limit."""
    return timedelta(seconds=resolve_limits({"startup": DEFAULT_LIMITS["startup"]})["startup"] + COLLECTIVE_MARGIN_S)


_KEEP_TIMEOUT: set[int] = set()  # ids of groups with a timeout of their own (the background checkpoint writer's)


def keep_own_timeout(group) -> None:
    """Leave `group`'s timeout alone when the phases change (the background writer's collectives overlap steps)."""
    _KEEP_TIMEOUT.add(id(group))


def save_collective_timeout() -> timedelta:
    """The timeout of the background checkpoint writer's group: the save limit."""
    return timedelta(seconds=resolve_limits({"save": DEFAULT_LIMITS["save"]})["save"] + COLLECTIVE_MARGIN_S)


def set_collective_timeout(seconds: float) -> None:
    """Every process group of this rank (the strategy's, DeepSpeed's) times out its collectives after `seconds`."""
    if not dist.is_initialized():
        return
    for group in list(_world.pg_map):
        if id(group) in _KEEP_TIMEOUT:
            continue
        try:
            _set_pg_timeout(timedelta(seconds=seconds), group)
        except (ValueError, RuntimeError, AssertionError):
            pass  # a group this rank is not part of, or a backend without settable timeouts


LIBRARIES = ("torch.", "deepspeed", "lightning")


def waiting_collective(thread_id: int) -> str | None:
    """The torch.distributed call a thread is blocked in, and the first frame outside the libraries that led to it."""
    frame = sys._current_frames().get(thread_id)
    collective, caller = None, None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if collective is None and module == "torch.distributed.distributed_c10d":
            collective = frame.f_code.co_name
        elif collective is not None and caller is None and not module.startswith(LIBRARIES):
            caller = f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    if collective is None:
        return None
    return f"torch.distributed.{collective}" + (f", called from {caller}" if caller else "")


class HangWatchdog(Callback):
    """Added to every `mtnlg fit` (`model.watchdog: false` leaves it out); add it to `trainer.callbacks` to change
    the limits (seconds): startup_timeout, step_timeout, save_timeout, eval_timeout."""

    def __init__(
        self,
        startup_timeout: float = DEFAULT_LIMITS["startup"],
        step_timeout: float = DEFAULT_LIMITS["step"],
        save_timeout: float = DEFAULT_LIMITS["save"],
        eval_timeout: float = DEFAULT_LIMITS["eval"],
        poll_interval: float = 1.0,
    ):
        self.configured = {"startup": startup_timeout, "step": step_timeout, "save": save_timeout, "eval": eval_timeout}
        self.limits = resolve_limits(self.configured)
        self.poll_interval = poll_interval
        self.phase, self.since, self.step = "startup", time.monotonic(), 0
        self._first_step_done = False
        self._collective_limit: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rank = 0

    # ------------------------------------------------------------------ heartbeats
    def beat(self, phase: str | None = None, step: int | None = None) -> None:
        with self._lock:
            if phase is not None and (phase != "step" or self._first_step_done):
                self.phase = phase
            if step is not None:
                self.step = step
            self.since = time.monotonic()
        self._follow_collective_timeout()

    def _follow_collective_timeout(self) -> None:
        limit = self.limits[self.phase] + COLLECTIVE_MARGIN_S
        if limit != self._collective_limit:
            self._collective_limit = limit
            set_collective_timeout(limit)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.limits = resolve_limits(self.configured)  # the environment of this process, not the parser's
        self.rank = trainer.global_rank
        self.beat("startup")
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="mtnlg-watchdog", daemon=True)
            self._thread.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.beat("step", trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._first_step_done = True
        self.beat("step", trainer.global_step)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.beat("save")

    def on_validation_start(self, trainer, pl_module) -> None:
        self.beat("eval")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.beat("eval")

    def on_validation_end(self, trainer, pl_module) -> None:
        self.beat("step" if self._first_step_done else "startup")

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    # ------------------------------------------------------------------ the watchdog thread
    def _watch(self) -> None:
        while not self._stop.wait(self.poll_interval):
            with self._lock:
                phase, waited, step = self.phase, time.monotonic() - self.since, self.step
            if waited > self.limits[phase]:
                self._fire(phase, waited, step)

    def _fire(self, phase: str, waited: float, step: int) -> None:
        limit = self.limits[phase]
        where = waiting_collective(threading.main_thread().ident)
        lines = [
            f"mtnlg watchdog: rank {self.rank} on {socket.gethostname()} (pid {os.getpid()}): no progress in "
            f"{phase} for {waited:.0f} s (limit {limit:g} s, {ENV_VARS[phase]}) at step {step}",
            f"mtnlg watchdog: waiting in {where}" if where else "mtnlg watchdog: not in a torch.distributed call",
            f"mtnlg watchdog: stacks of every thread follow; exiting with {int(ExitCode.HANG)} (hang)",
        ]
        print("\n".join(lines), file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(int(ExitCode.HANG))
