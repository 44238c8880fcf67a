"""Fault injection for the curation resume tests: kill a dedup or decontamination run at a named point
(``<stage>``, ``<stage>:task<i>``, ``publish:<i>``, ``commit:upload:<i>``, ``commit:copy:<i>``), by
``os._exit(86)`` or by raising :class:`SimulatedCrash`, or kill the worker process running the first task of a
stage once.

The package knows nothing of it: inside ``with Faults(...):`` the stage runner (`corpora/stages.py`), the publish
steps of the two jobs (`DedupJob.move_output`, `DecontamJob.assemble_outputs`) and the object-store commit
(`corpora/commit.py`) are wrapped so that each reports the point it has just passed. Run as a script,
``python tests/curation_faults.py dedup ARGS...`` is `mtnlg-dedup ARGS...` killed at the point named by the
environment variable ``MTNLG_CURATION_CRASH_AT`` (a real process death for the CLI tests).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from unittest import mock

import mtnlg_lightning.corpora.commit as commit_module
import mtnlg_lightning.corpora.storage as storage
import mtnlg_lightning.curation.decontaminate as decontaminate_module
import mtnlg_lightning.curation.dedup as dedup_module
from mtnlg_lightning.corpora.stages import StageRunner

CRASH_ENV = "MTNLG_CURATION_CRASH_AT"
# the publish steps of each job: after the n-th call of one job, the run has passed `publish:<n>`
PUBLISH_STEPS = ((dedup_module.DedupJob, "move_output"), (decontaminate_module.DecontamJob, "assemble_outputs"))
# the modules that call `commit` by that name
COMMIT_CALLERS = (commit_module, dedup_module, decontaminate_module)


class SimulatedCrash(BaseException):
    """Raised at a crash point when :class:`Faults` asks for an exception instead of a process exit."""


@dataclass
class Faults:
    """Off by default: kill the run at ``crash_at``, by ``os._exit(86)`` or by raising :class:`SimulatedCrash`;
    or kill the worker process running the first task of stage ``kill_worker_in`` once (``kill_worker_flag``
    records that it happened). Active inside ``with``."""

    crash_at: str | None = None
    raise_instead: bool = False
    kill_worker_in: str | None = None
    kill_worker_flag: str | None = None
    _patches: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False, compare=False)
    _published: Counter = field(default_factory=Counter, repr=False, compare=False)

    @classmethod
    def from_env(cls) -> Faults:
        return cls(crash_at=os.environ.get(CRASH_ENV) or None)

    def point(self, name: str) -> None:
        """The run has just finished the unit of work ``name`` (its files are written)."""
        if self.crash_at != name:
            return
        if self.raise_instead:
            raise SimulatedCrash(name)
        os._exit(86)

    def wrap_task(self, stage: str, fn):
        """The task function the engine runs for ``stage``."""
        if self.kill_worker_in == stage and self.kill_worker_flag:
            return KillWorkerOnce(fn, self.kill_worker_flag)
        return fn

    def __enter__(self) -> Faults:
        patch = self._patches.enter_context
        patch(mock.patch.object(StageRunner, "run", self._stages(StageRunner.run)))
        patch(mock.patch.object(StageRunner, "map", self._tasks(StageRunner.map)))
        for job, method in PUBLISH_STEPS:
            patch(mock.patch.object(job, method, self._publish_step(getattr(job, method))))
        for module in COMMIT_CALLERS:
            patch(mock.patch.object(module, "commit", self._commit(module.commit)))
        return self

    def __exit__(self, *exc) -> None:
        self._patches.close()

    # ------------------------------------------------------------------ the wrapped steps
    def _stages(self, run):
        """`StageRunner.run` passing `<stage>` after each stage it runs (not after one it resumes)."""

        def stages(runner, todo):
            for stage in todo:
                run(runner, [stage])
                if stage.name not in runner.resumed:
                    self.point(stage.name)
            return runner.stats

        return stages

    def _tasks(self, map_tasks):
        """`StageRunner.map` running the wrapped task and passing `<stage>:task<i>` after each finished task."""

        def tasks(runner, stage, fn, items, shared=None, **kwargs):
            results = map_tasks(runner, stage, self.wrap_task(stage, fn), items, shared, **kwargs)
            with contextlib.closing(results):
                for i, result in enumerate(results, start=1):
                    yield result
                    self.point(f"{stage}:task{i}")

        return tasks

    def _publish_step(self, step):
        """A job's publish step passing `publish:<n>` after its n-th call by that job."""

        @functools.wraps(step)
        def publish(job, *args, **kwargs):
            result = step(job, *args, **kwargs)
            self._published[id(job)] += 1
            self.point(f"publish:{self._published[id(job)]}")
            return result

        return publish

    def _commit(self, commit):
        """`commit` passing `commit:upload:<i>` and `commit:copy:<i>` after each upload and each copy it makes."""

        def counted(files, markers=1):
            steps: Counter = Counter()

            def step(kind, action):
                def run(*args, **kwargs):
                    action(*args, **kwargs)
                    steps[kind] += 1
                    self.point(f"commit:{kind}:{steps[kind]}")

                return run

            with (
                mock.patch.object(storage, "upload", step("upload", storage.upload)),
                mock.patch.object(storage, "copy", step("copy", storage.copy)),
            ):
                commit(files, markers)

        return counted


class KillWorkerOnce:
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


def main(argv: list[str]) -> int:
    """Run a curation CLI with the faults the environment names."""
    from mtnlg_lightning.curation import dedup_cli

    tool, args = argv[0], argv[1:]
    if tool != "dedup":
        raise SystemExit(f"curation_faults: error: unknown tool {tool!r} (known: dedup)")
    with Faults.from_env():
        return dedup_cli.main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
