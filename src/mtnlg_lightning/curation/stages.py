"""One runner for the curation pipelines: stage order, done markers, timing, resume and testing crash points.

A stage is an object with a ``name`` and ``run(runner) -> dict`` (its statistics). The runner skips a stage whose
``<work>/<name>.done`` marker exists (and loads its statistics), otherwise runs it, adds ``seconds`` and writes
the marker atomically. Stages keep their own partial progress in files (a finished shard is not redone), so a
killed run re-run with the same work directory resumes where it stopped, with either engine.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Protocol

from tqdm.auto import tqdm

from .jsonl import write_json_atomic

CRASH_ENV = "MTNLG_CURATION_CRASH_AT"  # testing hook: simulate a killed run (os._exit) at a named point


class SimulatedCrash(BaseException):
    """Raised at a crash point when :class:`Faults` asks for an exception instead of a process exit (tests)."""


@dataclass
class Faults:
    """Testing hooks, off by default: kill the run at a named point (``<stage>``, ``<stage>:task<i>``,
    ``publish:<i>``), by ``os._exit(86)`` or by raising :class:`SimulatedCrash`; or kill the worker process
    running the first task of stage ``kill_worker_in`` once (``kill_worker_flag`` records that it happened)."""

    crash_at: str | None = None
    raise_instead: bool = False
    kill_worker_in: str | None = None
    kill_worker_flag: str | None = None

    @classmethod
    def from_env(cls) -> Faults:
        return cls(crash_at=os.environ.get(CRASH_ENV) or None)

    def point(self, name: str) -> None:
        if self.crash_at != name:
            return
        if self.raise_instead:
            raise SimulatedCrash(name)
        os._exit(86)


class _KillWorkerOnce:
    """Wraps a task: the first call anywhere (the flag file does not exist yet) kills its worker process."""

    def __init__(self, fn, flag: str):
        self.fn, self.flag = fn, flag

    def __call__(self, shared, item):
        try:
            fd = os.open(self.flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return self.fn(shared, item)
        os.close(fd)
        os._exit(87)


class Progress:
    """tqdm bars, or silent ones."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, **kw):
        return tqdm(disable=not self.enabled, dynamic_ncols=True, leave=False, **kw)


class Stage(Protocol):
    name: str

    def run(self, runner: StageRunner) -> dict: ...


class StageRunner:
    def __init__(self, work_dir: str, engine, progress: Progress, faults: Faults | None = None):
        self.work = work_dir
        self.engine = engine
        self.progress = progress
        self.faults = faults or Faults()
        self.stats: dict[str, dict] = {}
        self.resumed: list[str] = []

    def path(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    def done_path(self, stage: str) -> str:
        return self.path(f"{stage}.done")

    def is_done(self, stage: str) -> bool:
        return os.path.exists(self.done_path(stage))

    def run(self, stages: list[Stage]) -> dict[str, dict]:
        for stage in stages:
            if self.is_done(stage.name):
                with open(self.done_path(stage.name)) as f:
                    self.stats[stage.name] = json.load(f)
                self.resumed.append(stage.name)
                continue
            t0 = time.perf_counter()
            stats = stage.run(self)
            stats = {"seconds": time.perf_counter() - t0, **stats}
            write_json_atomic(self.done_path(stage.name), stats)
            self.stats[stage.name] = stats
            self.faults.point(stage.name)
        return self.stats

    def map(self, stage: str, fn, items: list, shared=None, *, total=None, unit="task", size=None):
        """Run ``fn(shared, item)`` for every item on the engine, in order, with a progress bar and a crash point
        after every finished task (``<stage>:task<i>``). ``size(item)`` weighs the bar (default 1 per task)."""
        if self.faults.kill_worker_in == stage and self.faults.kill_worker_flag:
            fn = _KillWorkerOnce(fn, self.faults.kill_worker_flag)
        bar = self.progress(total=total if total is not None else len(items), unit=unit, desc=stage)
        try:
            for i, (item, res) in enumerate(zip(items, self.engine.map(fn, items, shared), strict=True)):
                bar.update(size(item) if size else 1)
                yield res
                self.faults.point(f"{stage}:task{i + 1}")
        finally:
            bar.close()
