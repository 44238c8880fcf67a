"""One runner for the curation pipelines: stage order, done markers, timing and resume.

A stage is an object with a ``name`` and ``run(runner) -> dict`` (its statistics). The runner skips a stage whose
``<work>/<name>.done`` marker exists (and loads its statistics), otherwise runs it, adds ``seconds`` and writes
the marker atomically. Stages keep their own partial progress in files (a finished shard is not redone), so a
killed run re-run with the same work directory resumes where it stopped, with either engine.
"""

from __future__ import annotations

import json
import os
import time
from typing import Generic, Protocol, TypeVar

from tqdm.auto import tqdm

from mtnlg_lightning.corpora.jsonl import write_json_atomic


class Progress:
    """tqdm bars, or silent ones."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, **kw):
        return tqdm(disable=not self.enabled, dynamic_ncols=True, leave=False, **kw)


class Stage(Protocol):
    name: str

    def run(self, runner: StageRunner) -> dict: ...


Context = TypeVar("Context")


class ContextStage(Generic[Context]):
    """A stage of one job: its settings, inputs and work paths are the job's context ``ctx`` (a DedupContext or a
    DecontamContext); the subclass names itself and runs."""

    name: str

    def __init__(self, ctx: Context):
        self.ctx = ctx


class StageRunner:
    def __init__(self, work_dir: str, engine, progress: Progress):
        self.work = work_dir
        self.engine = engine
        self.progress = progress
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
        return self.stats

    def map(self, stage: str, fn, items: list, shared=None, *, total=None, unit="task", size=None):
        """Run ``fn(shared, item)`` for every item on the engine, in order, with a progress bar. ``size(item)``
        weighs the bar (default 1 per task)."""
        bar = self.progress(total=total if total is not None else len(items), unit=unit, desc=stage)
        try:
            for item, res in zip(items, self.engine.map(fn, items, shared), strict=True):
                bar.update(size(item) if size else 1)
                yield res
        finally:
            bar.close()
