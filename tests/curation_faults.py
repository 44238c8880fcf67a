"""Fault injection for the curation resume tests: kill a dedup or decontamination run at a named point of its
stage runner (``<stage>``, ``<stage>:task<i>``, ``publish:<i>``), by ``os._exit(86)`` or by raising
:class:`SimulatedCrash`, or kill the worker process running the first task of a stage once.

The package only offers the hook points (`curation/stages.py` `StageHooks`); the faults live here. Run as a
script, ``python tests/curation_faults.py dedup ARGS...`` is `mtnlg-dedup ARGS...` killed at the point named by
the environment variable ``MTNLG_CURATION_CRASH_AT`` (a real process death for the CLI tests).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

from mtnlg_lightning.corpora.stages import StageHooks

CRASH_ENV = "MTNLG_CURATION_CRASH_AT"


class SimulatedCrash(BaseException):
    """Raised at a crash point when :class:`Faults` asks for an exception instead of a process exit."""


@dataclass
class Faults(StageHooks):
    """Off by default: kill the run at ``crash_at``, by ``os._exit(86)`` or by raising :class:`SimulatedCrash`;
    or kill the worker process running the first task of stage ``kill_worker_in`` once (``kill_worker_flag``
    records that it happened)."""

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

    def wrap_task(self, stage: str, fn):
        if self.kill_worker_in == stage and self.kill_worker_flag:
            return KillWorkerOnce(fn, self.kill_worker_flag)
        return fn


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
    from mtnlg_lightning.curation import dedup, dedup_cli

    tool, args = argv[0], argv[1:]
    if tool != "dedup":
        raise SystemExit(f"curation_faults: error: unknown tool {tool!r} (known: dedup)")
    dedup_cli.run_dedup = functools.partial(dedup.run_dedup, hooks=Faults.from_env())
    return dedup_cli.main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
