"""`python -m mtnlg_lightning.resilience.launch`: torchrun (same arguments) with restarts that only retry what a
restart can fix, and an exit status that says what happened (`exit_codes.py`).

    python -m mtnlg_lightning.resilience.launch --nnodes 1 --nproc-per-node 8 --max-restarts 3 \\
        -m mtnlg_lightning.train.cli fit --config ... --ckpt_path last

Differences from plain torchrun, whose agent restarts the group on any worker failure and exits 1 on every failure:
- a configuration error (exit 2) or a preemption (exit 75) of any worker ends the run with that code; no restart
  is spent on it (each node's agent decides alike, since every rank fails alike). The other ranks end alike but
  not at the same moment, so they are given up to CLEAN_END_GRACE_S to print their error line or finish their
  save (torchrun would SIGTERM them at the first exit, and a slow rank 0 would never print the one error line);
- the run exits with the most telling worker code (config error > preempted > hang > crash), 0 when finished;
- the rest of a crashed or hung group is stopped with SIGKILL at once: a stopped or stuck rank ignores torchrun's
  SIGTERM for its 30 s grace period, and the surviving ranks have lost a peer, so they cannot save anything anyway;
- SIGTERM and SIGUSR1 sent to the launcher reach the workers (torchrun would kill them on SIGTERM and die of an
  unhandled SIGUSR1), so `checkpoint.preemption.Preemption` saves and the run exits 75;
- the restarted workers learn why (`MTNLG_RESTART_CAUSE`), which they log in their "restart k: resumed" line.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from mtnlg_lightning.resilience.exit_codes import NOT_RETRIED, ExitCode, describe, run_exit_code
from mtnlg_lightning.resilience.restart import RESTART_CAUSE_ENV

FORWARDED_SIGNALS = ("SIGTERM", "SIGUSR1")
CLEAN_END_GRACE_S = 120.0  # how long the rest of a group may take to end alike after one rank's clean end
log = logging.getLogger("mtnlg.launch")


class ResilientAgent(LocalElasticAgent):
    """torchrun's local agent with the restart policy above."""

    _failed_first: dict[int, int] = {}  # local rank -> exit code of the workers that failed by themselves
    _clean_end_since: float | None = None  # when the first rank ended with a code that is not retried

    def _monitor_workers(self, worker_group):
        codes = self._exit_codes()
        ended = {rank: code for rank, code in codes.items() if code not in (None, 0)}
        running = [rank for rank, code in codes.items() if code is None]
        clean_end = bool(ended) and run_exit_code(list(ended.values())) in NOT_RETRIED
        if ended and not clean_end:
            self._kill_peers_of_a_failed_worker(ended, running)
        if self._peers_of_a_clean_end_still_ending(clean_end and bool(running)):
            return RunResult(state=WorkerState.HEALTHY)  # not yet: torchrun's poll would SIGTERM them
        result = super()._monitor_workers(worker_group)
        if result.is_failed():
            rank_of = {w.local_rank: w.global_rank for w in worker_group.workers}
            own = self._failed_first or {r: f.exitcode for r, f in result.failures.items()}
            causes = [f"rank {rank_of.get(r, r)} {describe(code)}" for r, code in sorted(own.items())]
            self._failed_first = {}
            os.environ[RESTART_CAUSE_ENV] = "; ".join(causes)  # the next workers inherit the agent's environment
            code = run_exit_code([f.exitcode for f in result.failures.values()])
            if code in NOT_RETRIED and self._remaining_restarts > 0:
                print(f"mtnlg launch: {describe(code)}: not restarting ({'; '.join(causes)})", file=sys.stderr)
                self._remaining_restarts = 0
        return result

    def _exit_codes(self) -> dict[int, int | None]:
        """local rank -> exit code, None while running."""
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        return {rank: handler.proc.poll() for rank, handler in handlers.items()}

    def _peers_of_a_clean_end_still_ending(self, waiting: bool) -> bool:
        """`waiting`: a rank ended with a configuration error or a preemption and others still run. They will end
        alike (rank 0 prints the error line; every rank finishes its save): wait for them, up to
        CLEAN_END_GRACE_S after the first such end."""
        if not waiting:
            self._clean_end_since = None
            return False
        if self._clean_end_since is None:
            self._clean_end_since = time.monotonic()
        return time.monotonic() - self._clean_end_since < CLEAN_END_GRACE_S

    def _kill_peers_of_a_failed_worker(self, failed: dict[int, int], running: list[int]) -> None:
        """torchrun stops the rest of a failed group with SIGTERM and waits 30 s before SIGKILL; a stopped or stuck
        rank ignores SIGTERM, and the others have lost a peer, so they cannot save anything: kill them now. (A
        configuration error or a preemption is a clean end on every rank: those ranks are left to finish.)"""
        self._failed_first = failed  # the cause, told apart from the ranks killed here
        for rank in running:
            self._pcontext.subprocess_handlers[rank].proc.kill()

    def _start_workers(self, worker_group):
        started = super()._start_workers(worker_group)
        # torchrun installs its own handlers when the workers start: forward ours instead, from then on.
        for name in FORWARDED_SIGNALS:
            signal.signal(getattr(signal, name), self._forward)
        return started

    def _forward(self, signum, frame) -> None:
        context = self._pcontext
        for pid in context.pids().values() if context is not None else []:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def main(argv: list[str] | None = None) -> None:
    if not hasattr(launcher_api, "LocalElasticAgent"):
        raise SystemExit("mtnlg launch: error: this torch builds torchrun's agent elsewhere; use plain torchrun")
    launcher_api.LocalElasticAgent = ResilientAgent  # the one name torchrun's launch_agent builds its agent from
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] in (["-h"], ["--help"]):
        print(__doc__.strip() + "\n\nThe arguments are torchrun's:\n", flush=True)
    try:
        run(parse_args(arguments))
    except ChildFailedError as error:
        code = run_exit_code([f.exitcode for f in error.failures.values()])
        print(f"mtnlg launch: run ended: {describe(int(code))}", file=sys.stderr)
        sys.exit(int(code))
    sys.exit(int(ExitCode.FINISHED))


if __name__ == "__main__":
    main()
