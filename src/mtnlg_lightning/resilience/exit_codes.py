"""What a run's exit status means. One table for the workers, the launcher (`resilience/launch.py`) and the SLURM
batch script of docs/runbook.md, which decides from it whether to requeue.

    0   FINISHED      max_steps / max_epochs reached; nothing to do
    1   CRASH         an exception or a killed rank; a restart from the newest checkpoint may heal it
    2   CONFIG_ERROR  bad configuration or input (one line `mtnlg: error: ...`); a restart cannot fix it: not retried
    75  PREEMPTED     a signal (SIGTERM / SIGUSR1) made every rank save and stop: requeue the job, it resumes itself
    124 HANG          the watchdog found a rank without progress (stack dump on stderr); restart the group

75 is sysexits' EX_TEMPFAIL ("try again later"), 124 is what `timeout(1)` returns.
"""

from __future__ import annotations

import signal
from enum import IntEnum


class ExitCode(IntEnum):
    FINISHED = 0
    CRASH = 1
    CONFIG_ERROR = 2
    PREEMPTED = 75
    HANG = 124


# A restart cannot fix these: the launcher stops instead of spending a restart on them.
NOT_RETRIED = (ExitCode.CONFIG_ERROR, ExitCode.PREEMPTED)
# When ranks end differently, the code of the whole run is the most telling one (a configuration error or a
# preemption explains the other ranks' ends; a hang explains peers that crashed on the closed connection).
_PRECEDENCE = (ExitCode.CONFIG_ERROR, ExitCode.PREEMPTED, ExitCode.HANG, ExitCode.CRASH)


def run_exit_code(worker_codes: list[int]) -> ExitCode:
    """The run's code from its workers' exit statuses (negative = killed by that signal, as subprocess reports)."""
    known = {ExitCode(c) if c in ExitCode._value2member_map_ else ExitCode.CRASH for c in worker_codes}
    known.discard(ExitCode.FINISHED)
    for code in _PRECEDENCE:
        if code in known:
            return code
    return ExitCode.FINISHED


def describe(code: int) -> str:
    """A few words for logs: 'hang (exit 124)', 'killed by SIGKILL', 'crash (exit 1)'."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code in ExitCode._value2member_map_:
        return f"{ExitCode(code).name.lower().replace('_', ' ')} (exit {code})"
    return f"crash (exit {code})"
