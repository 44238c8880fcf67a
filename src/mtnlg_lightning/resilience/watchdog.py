"""Hang detection: the training loop beats a heartbeat; a watchdog thread ends a rank that stops progressing.

Each phase has its own limit (seconds without a heartbeat): `startup` (process start to the end of the first step:
building, loading a checkpoint, the first step), `step` (batch start to batch end), `data` (batch end to the next
batch start: the data wait and the work between steps), `save`, `eval`. Limits learn (`phase_limits.py`): a phase
starts from its cap (config key, environment, default) and, once seen, gets 5 x the longest interval seen in it,
never below a floor (30 s; 120 s at start-up) nor above the cap. The longest intervals travel with the checkpoint,
so a restarted run starts with them, start-up included.

When a limit passes, the rank prints the phase, how long it waited, the limit and how it was learned, the collective
its main thread waits in, dumps every thread's Python stack (faulthandler), and exits with `ExitCode.HANG` (124) so
the launcher restarts the group from the newest checkpoint. A rank that is itself frozen (SIGSTOP, a dead GPU)
cannot do this: its peers, blocked in a collective with it, do it for it.

The process groups' collective timeout follows the same limits (phase limit + COLLECTIVE_MARGIN_S, so the watchdog's
diagnosis comes first and the collective timeout stays a backstop): the startup limit at initialisation, then the
limit of each phase (tightened after the first step, as torchtitan does).

Environment variables override the config keys (the caps), so an operator can set them in a batch script:
MTNLG_STARTUP_TIMEOUT, MTNLG_STEP_TIMEOUT, MTNLG_DATA_TIMEOUT, MTNLG_SAVE_TIMEOUT, MTNLG_EVAL_TIMEOUT (seconds).
Work of another size inside a phase (a downstream evaluation between steps, a loss-spike rewind's checkpoint load,
the wait for a background checkpoint write) beats with `heartbeat.heartbeat(phase, what)` and is learned apart.
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

from mtnlg_lightning.checkpoint.format import read_meta
from mtnlg_lightning.heartbeat import unwatch, watch
from mtnlg_lightning.resilience.attempt import restart_count
from mtnlg_lightning.resilience.exit_codes import ExitCode
from mtnlg_lightning.resilience.phase_limits import (
    DEFAULT_CAPS,
    ENV_VARS,
    FLOORS,
    PHASES,
    RESUMING_STARTUP,
    SAFETY_FACTOR,
    PhaseLimits,
    resolve_limits,
)
from mtnlg_lightning.resilience.rank_status import read_statuses, status_dir, write_status
from mtnlg_lightning.resilience.restart import checkpoint_dirs, newest_checkpoint
from mtnlg_lightning.resilience.restart_record import layout_of
from mtnlg_lightning.torch_compat import process_groups, set_group_timeout

COLLECTIVE_MARGIN_S = 30.0
__all__ = ["ENV_VARS", "FLOORS", "PHASES", "SAFETY_FACTOR", "HangWatchdog", "resolve_limits"]


def startup_collective_timeout() -> timedelta:
    """The process groups' timeout at initialisation (before any callback is known): the startup cap."""
    return timedelta(seconds=resolve_limits({"startup": DEFAULT_CAPS["startup"]})["startup"] + COLLECTIVE_MARGIN_S)


_KEEP_TIMEOUT: set[int] = set()  # ids of groups with a timeout of their own (the background checkpoint writer's)


def keep_own_timeout(group) -> None:
    """Leave `group`'s timeout alone when the phases change (the background writer's collectives overlap steps)."""
    _KEEP_TIMEOUT.add(id(group))


def save_collective_timeout() -> timedelta:
    """The timeout of the background checkpoint writer's group: the save cap."""
    return timedelta(seconds=resolve_limits({"save": DEFAULT_CAPS["save"]})["save"] + COLLECTIVE_MARGIN_S)


def set_collective_timeout(seconds: float) -> None:
    """Every process group of this rank (the strategy's, DeepSpeed's) times out its collectives after `seconds`."""
    if not dist.is_initialized():
        return
    for group in process_groups():
        if id(group) in _KEEP_TIMEOUT:
            continue
        try:
            set_group_timeout(timedelta(seconds=seconds), group)
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
    the caps (seconds: startup_timeout, step_timeout, data_timeout, save_timeout, eval_timeout), the safety factor
    or the floors ({phase: seconds})."""

    def __init__(
        self,
        startup_timeout: float = DEFAULT_CAPS["startup"],
        step_timeout: float = DEFAULT_CAPS["step"],
        data_timeout: float = DEFAULT_CAPS["data"],
        save_timeout: float = DEFAULT_CAPS["save"],
        eval_timeout: float = DEFAULT_CAPS["eval"],
        safety_factor: float = SAFETY_FACTOR,
        floors: dict[str, float] | None = None,
        poll_interval: float = 1.0,
    ):
        configured = {
            "startup": startup_timeout,
            "step": step_timeout,
            "data": data_timeout,
            "save": save_timeout,
            "eval": eval_timeout,
        }
        self.limits = PhaseLimits(configured, safety_factor, floors)
        self.poll_interval = poll_interval
        self.key, self.since, self.last_beat, self.step = "startup", time.monotonic(), time.time(), 0
        self._first_step_done = False
        self._resuming = False
        self._collective_limit: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rank, self.local_rank, self.host = 0, 0, socket.gethostname()
        self._status: dict = {}
        self._written: tuple | None = None
        self._step_seconds = [0.0, 0]  # sum and count of this process's steps, for the mean in the status
        self.hang: str | None = None

    # ------------------------------------------------------------------ heartbeats
    def beat(self, phase: str | None = None, step: int | None = None, what: str | None = None) -> None:
        """The interval since the last heartbeat ends (and is learned, under the key it ran in); `phase` starts."""
        with self._lock:
            now = time.monotonic()
            elapsed = now - self.since
            self.limits.observe(self.key, elapsed)
            if self.key == "step":
                self._step_seconds = [self._step_seconds[0] + elapsed, self._step_seconds[1] + 1]
            if phase is not None:
                if phase in ("startup", "step") and not self._first_step_done:
                    self.key = self._startup_key()
                else:
                    self.key = phase if what is None else f"{phase}:{what}"
            if step is not None:
                self.step = step
            self.since, self.last_beat = now, time.time()
        self._follow_collective_timeout()
        self._publish_status()

    def _startup_key(self) -> str:
        return RESUMING_STARTUP if self._resuming else "startup"

    def current_limit(self) -> float:
        return self.limits.limit(self.key)

    def _follow_collective_timeout(self) -> None:
        limit = self.current_limit() + COLLECTIVE_MARGIN_S
        if limit != self._collective_limit:
            self._collective_limit = limit
            set_collective_timeout(limit)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.limits.reload_caps()  # the environment of this process, not the parser's
        self.rank, self.local_rank = trainer.global_rank, trainer.local_rank
        self._learn_from_the_runs_before(trainer)
        self._status = self._status_header(trainer)
        self.beat("startup")
        watch(self)
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="mtnlg-watchdog", daemon=True)
            self._thread.start()

    def _learn_from_the_runs_before(self, trainer) -> None:
        """A restarted run starts with the limits learned before it, start-up included, from the checkpoint it will
        resume (the one `resilience/restart.py` resolves), read before loading it, and from the statuses the
        attempt before left on this node: a checkpoint holds what was learned until it was taken, not its own save
        nor anything after it (a run that resumes from step 4 after a fault in the save of step 6 would otherwise
        never have seen a save)."""
        count = restart_count()
        if count == 0:
            return
        for status in read_statuses(status_dir(), count - 1):
            self.limits.load_state_dict(status.get("learned") or {})
        path = newest_checkpoint(checkpoint_dirs(trainer))
        if path is None:
            return
        try:
            state = read_meta(path).get("callbacks", {}).get(self.state_key)
        except Exception:  # noqa: BLE001 - the load checks this checkpoint and reports it; here it only informs
            return
        if isinstance(state, dict):
            self.load_state_dict(state)

    def on_train_start(self, trainer, pl_module) -> None:
        self._status["resumed_step"] = int(trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.beat("step", trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._first_step_done = True
        self.beat("data", trainer.global_step)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.beat("save")

    def on_validation_start(self, trainer, pl_module) -> None:
        self.beat("eval")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.beat("eval")

    def on_validation_end(self, trainer, pl_module) -> None:
        self.beat("data" if self._first_step_done else "startup")

    def on_train_end(self, trainer, pl_module) -> None:
        """Training is over: what is left (loggers uploading, the last background write) has no phase to learn
        from. The watching ends; collectives get the start-up cap again, as before the first step."""
        self.stop()
        set_collective_timeout(self.limits.caps["startup"] + COLLECTIVE_MARGIN_S)
        if trainer.is_global_zero:
            print(f"mtnlg watchdog: learned limits at step {trainer.global_step}: {self.limits.summary()}", flush=True)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.stop()

    def stop(self) -> None:
        unwatch(self)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    # ------------------------------------------------------------------ what travels with the checkpoint
    def state_dict(self) -> dict:
        with self._lock:
            return {"limits": self.limits.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        with self._lock:
            self.limits.load_state_dict(state_dict.get("limits", {}))
            self._resuming = True
            if not self._first_step_done:
                self.key = self._startup_key()
        self._follow_collective_timeout()

    # ------------------------------------------------------------------ the watchdog thread
    def _watch(self) -> None:
        while not self._stop.wait(self.poll_interval):
            with self._lock:
                key, waited, step, limit = self.key, time.monotonic() - self.since, self.step, self.current_limit()
            if waited > limit:
                self._fire(key, waited, step, limit)

    def _status_header(self, trainer) -> dict:
        try:
            layout = layout_of(trainer)
        except Exception:  # noqa: BLE001 - a strategy without these attributes: the status goes without a layout
            layout = None
        return {
            "attempt": restart_count(),
            "rank": self.rank,
            "local_rank": self.local_rank,
            "host": self.host,
            "pid": os.getpid(),
            "started": time.time(),
            "layout": layout,
        }

    def _publish_status(self) -> None:
        """This rank's phase, step and last progress, in its node-local status file when they changed (at every
        heartbeat that changes them: a local temporary file, ~0.1 ms; it must be current when a kill -9 lands)."""
        directory = status_dir()
        if directory is None or not self._status:
            return
        with self._lock:
            changed = (self.key, self.step, self.hang)
            total, count = self._step_seconds
            status = {
                **self._status,
                "phase": self.key,
                "step": self.step,
                "last_beat": self.last_beat,
                "mean_step_s": total / count if count else None,
                "hang": self.hang,
                "learned": self.limits.state_dict(),
            }
        if changed == self._written:
            return
        try:
            write_status(directory, status["attempt"], self.local_rank, status)
            self._written = changed
        except OSError:
            pass  # a full or read-only temporary folder must not end the run; the launcher then knows less

    def diagnosis(self, key: str, waited: float, step: int, limit: float) -> str:
        """The first line of a hang's report: which rank, where, the phase, the limit and how it was learned."""
        return (
            f"mtnlg watchdog: rank {self.rank} on {self.host} (pid {os.getpid()}): no progress in {key} for "
            f"{waited:.0f} s at step {step} (limit {limit:.0f} s, {self.limits.how(key)}; {self.limits.cap(key)})"
        )

    def _fire(self, key: str, waited: float, step: int, limit: float) -> None:
        where = waiting_collective(threading.main_thread().ident)
        self.hang = f"no progress in {key} for {waited:.0f} s (limit {limit:.0f} s) at step {step}"
        lines = [
            self.diagnosis(key, waited, step, limit),
            f"mtnlg watchdog: waiting in {where}" if where else "mtnlg watchdog: not in a torch.distributed call",
            f"mtnlg watchdog: stacks of every thread follow; exiting with {int(ExitCode.HANG)} (hang)",
        ]
        print("\n".join(lines), file=sys.stderr, flush=True)
        self._publish_status()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(int(ExitCode.HANG))
