"""Waiting on a launched run for an event (a step reached, a checkpoint published, a rank gone), not for a fixed
number of seconds: a loaded machine slows a run down, and a run that is still making progress is not a failure.

`RunWatch` watches a run's jobs (the launchers the test started), their logs and the files the run writes as it
goes (a probe's step lines, checkpoints, metrics, results). Each change of any watched file is a sign of progress;
the watch learns the run's own pace from them, as the trainer's watchdog learns its phase limits
(`resilience/phase_limits.py`): the idle window is `factor` (5) x the longest silence seen so far in this run (its
start-up, its slowest step or save), raised to a generous floor (300 s, `MTNLG_WAIT_FLOOR_S`). A wait

- returns as soon as its condition holds;
- fails at once when a watched job ends before it (`until`; `finish` waits for that end instead);
- fails when nothing progressed for the idle window (a hang), or when the watch's hard ceiling passes (counted
  from the watch's creation: 1500 s, `MTNLG_WAIT_CEILING_S`; a run that progresses but never gets there).

A failure says what the run was doing: what was awaited and for how long, when it last progressed, the idle window
and where it came from, every job with its processes (pid, state, command) and whether they are alive, anything the
test adds (`describe`: e.g. each rank's pid and last step), and the last 20 lines of each log.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

FLOOR_S = 300.0  # nothing written for 5 minutes: a generous floor for a start-up on a loaded 2-core machine
CEILING_S = 1500.0  # a whole drill, however it progresses; the drills' pytest timeout is above it
FACTOR = 5.0  # the trainer's watchdog allows 5 x the longest interval of a phase (resilience/phase_limits.py)
LOG_LINES = 20


def _seconds(variable: str, default: float) -> float:
    value = os.environ.get(variable)
    return float(value) if value else default


class RunWatch:
    def __init__(
        self,
        jobs: dict[str, tuple[subprocess.Popen, Path]] | None = None,
        progress: Iterable[Path] = (),
        describe: Callable[[], str] | None = None,
        floor_s: float | None = None,
        ceiling_s: float | None = None,
        factor: float = FACTOR,
        poll_s: float = 0.05,
    ):
        """`jobs`: name -> (job, its log); `progress`: more files or folders (read recursively) the run writes."""
        self.jobs: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.ended_on_purpose: set[str] = set()
        self.progress = [Path(p) for p in progress]
        self.describe = describe
        self.floor_s = _seconds("MTNLG_WAIT_FLOOR_S", FLOOR_S) if floor_s is None else floor_s
        self.ceiling_s = _seconds("MTNLG_WAIT_CEILING_S", CEILING_S) if ceiling_s is None else ceiling_s
        self.factor, self.poll_s = factor, poll_s
        self.started = time.monotonic()
        self.last_progress = self.started
        self.longest_silence = 0.0
        self.events = 0
        self._seen: dict[Path, tuple[int, int]] = {}
        self._scanned = 0.0
        for name, (job, log) in (jobs or {}).items():
            self.add(name, job, log)

    # ------------------------------------------------------------------------------------------------ what is watched
    def add(self, name: str, job: subprocess.Popen, log: Path) -> subprocess.Popen:
        self.jobs[name] = (job, Path(log))
        return job

    def stopped(self, name: str) -> None:
        """`name` was stopped by the test: its end is no failure."""
        self.ended_on_purpose.add(name)

    def watched_paths(self) -> list[Path]:
        return [log for _, log in self.jobs.values()] + self.progress

    # ------------------------------------------------------------------------------------------------ progress
    def _signature(self) -> dict[Path, tuple[int, int]]:
        found = {}
        for root in self.watched_paths():
            paths = root.rglob("*") if root.is_dir() else [root]
            for path in paths:
                try:
                    stat = path.stat()
                except OSError:
                    continue  # gone this instant (a staging folder renamed)
                found[path] = (stat.st_size, stat.st_mtime_ns)
        return found

    def observe(self) -> None:
        """Note the progress made since the last look (at most every 0.5 s: folders are read recursively)."""
        now = time.monotonic()
        if now - self._scanned < 0.5:
            return
        self._scanned = now
        signature = self._signature()
        if signature != self._seen:
            self._seen = signature
            self.longest_silence = max(self.longest_silence, now - self.last_progress)
            self.last_progress = now
            self.events += 1

    def idle_window(self) -> float:
        return min(max(self.factor * self.longest_silence, self.floor_s), self.ceiling_s)

    def _why_stop(self) -> str | None:
        now = time.monotonic()
        if now - self.last_progress > self.idle_window():
            return f"no progress for {now - self.last_progress:.0f} s (the idle window)"
        if now - self.started > self.ceiling_s:
            return f"the ceiling of {self.ceiling_s:.0f} s passed, the run still progressing"
        return None

    # ------------------------------------------------------------------------------------------------ waits
    def until(self, condition: Callable, what: str):
        """`condition()`'s first true value; fails when a watched job ends first, the run stalls or the ceiling
        passes."""
        waited = time.monotonic()
        while True:
            value = condition()
            if value:
                return value
            for name, (job, _) in self.jobs.items():
                if name not in self.ended_on_purpose and job.poll() is not None:
                    raise AssertionError(self.failure(what, waited, f"job {name} ended (rc {job.returncode}) first"))
            self.observe()
            why = self._why_stop()
            if why:
                raise AssertionError(self.failure(what, waited, why))
            time.sleep(self.poll_s)

    def finish(self, name: str, what: str = "") -> int:
        """The return code of job `name` once it ends by itself (the other jobs may end before it)."""
        job, _ = self.jobs[name]
        waited = time.monotonic()
        while job.poll() is None:
            self.observe()
            why = self._why_stop()
            if why:
                raise AssertionError(self.failure(what or f"job {name} to end", waited, why))
            time.sleep(self.poll_s)
        self.ended_on_purpose.add(name)  # ended: no failure for the waits after
        return job.returncode

    # ------------------------------------------------------------------------------------------------ the report
    def failure(self, what: str, waited_since: float, why: str) -> str:
        now = time.monotonic()
        lines = [
            f"gave up waiting for {what} after {now - waited_since:.0f} s: {why}",
            f"  the run: {now - self.started:.0f} s since the watch began, last progress {now - self.last_progress:.0f}"
            f" s ago ({self.events} changes seen); idle window {self.idle_window():.0f} s = max({self.factor:g} x the"
            f" longest silence {self.longest_silence:.1f} s, floor {self.floor_s:.0f} s),"
            f" ceiling {self.ceiling_s:.0f} s",
        ]
        processes = _processes()
        for name, (job, _) in self.jobs.items():
            state = "running" if job.poll() is None else f"ended (rc {job.returncode})"
            lines.append(f"  job {name} (pid {job.pid}): {state}")
            for pid, (state_letter, command) in _descendants(job.pid, processes):
                lines.append(f"    pid {pid} {_STATES.get(state_letter, state_letter)}: {command[:160]}")
        if self.describe is not None:
            try:
                lines += ["  " + line for line in self.describe().splitlines()]
            except Exception as error:  # noqa: BLE001 - the report must not hide the failure it reports
                lines.append(f"  (describe failed: {error!r})")
        for name, (_, log) in self.jobs.items():
            lines.append(f"  --- the last {LOG_LINES} lines of {name}'s log ({log}):")
            lines += ["  | " + line for line in tail(log, LOG_LINES)]
        return "\n".join(lines)


_STATES = {"R": "running", "S": "sleeping", "D": "in I/O", "T": "STOPPED", "t": "traced", "Z": "exited (zombie)"}


def tail(path: Path, lines: int = LOG_LINES) -> list[str]:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            text = handle.read().decode("utf-8", "replace")
    except OSError as error:
        return [f"(unreadable: {error})"]
    return text.splitlines()[-lines:] or ["(empty)"]


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state letter, command line) of every process this user can see (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        state, parent = stat.rsplit(")", 1)[1].split()[:2]
        found[int(entry.name)] = (int(parent), state, command)
    return found


def _descendants(pid: int, processes: dict[int, tuple[int, str, str]]) -> list[tuple[int, tuple[str, str]]]:
    children: dict[int, list[int]] = {}
    for child, (parent, _, _) in processes.items():
        children.setdefault(parent, []).append(child)
    found, queue = [], [pid]
    while queue:
        for child in sorted(children.get(queue.pop(0), [])):
            found.append((child, processes[child][1:]))
            queue.append(child)
    return found


def alive(pid: int) -> bool:
    """Running or stopped, not exited (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def run(
    command: list[str], log_dir: Path, name: str = "run", progress: Iterable[Path] = (), **popen_options
) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True)` under a `RunWatch` instead of a fixed timeout: its
    output goes to LOG_DIR/NAME.out and NAME.err (watched, with `progress`), and comes back in the result."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    out, err = log_dir / f"{name}.out", log_dir / f"{name}.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        job = subprocess.Popen(command, stdout=stdout, stderr=stderr, **popen_options)
    watch = RunWatch({name: (job, err)}, progress=[out, *progress])
    try:
        returncode = watch.finish(name, f"{name} to end")
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return subprocess.CompletedProcess(
        command, returncode, out.read_text(errors="replace"), err.read_text(errors="replace")
    )
