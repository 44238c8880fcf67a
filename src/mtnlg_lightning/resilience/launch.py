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
- the restarted workers learn why (`MTNLG_RESTART_CAUSE`, and `MTNLG_RESTART_RECORD` for `restarts.jsonl`): the
  exit code, rank, host, phase and step of every rank that failed by itself on any node (the launchers of all nodes
  exchange them at the next rendezvous), and the nodes that did not come back;
- every start of the group is numbered alike on all nodes (`MTNLG_ATTEMPT`), restarts for a node that joined or
  left included, and gets its own rendezvous key namespace (`MTNLG_ATTEMPT_ID`): torchrun's restart count stays the
  same on a membership change and can differ between nodes;
- when a node joins, the running ranks are given the time to finish their step and save (the step's and the save's
  limits, `phase_limits.py`) before the group restarts, where torchrun kills them 30 s after its SIGTERM: a large
  model's save takes minutes, and a rank killed in it redoes every step since the last periodic save;
- with a node range (`--nnodes MIN:MAX`, torchrun's elastic mode) a run that loses a node for good goes on with the
  nodes left, and grows back when nodes return; the workers resume in the largest layout the nodes hold (same
  TP x PP, fewer data-parallel replicas, the same global batch), and nodes beyond it wait as spares (`elastic.py`);
  the workers then get a rendezvous store of their own at every start (torchrun's shared one is never found by a
  node that joins);
- it prints a summary of the restarts at the end.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from mtnlg_lightning.resilience.attempt import ATTEMPT_ENV, ATTEMPT_ID_ENV, RESTART_CAUSE_ENV
from mtnlg_lightning.resilience.elastic import agree, layout_rule
from mtnlg_lightning.resilience.elastic_compat import ElasticAgent, install_agent
from mtnlg_lightning.resilience.exit_codes import NOT_RETRIED, ExitCode, describe, run_exit_code
from mtnlg_lightning.resilience.phase_limits import DEFAULT_CAPS, resolve_limits
from mtnlg_lightning.resilience.rank_status import STATUS_DIR_ENV, read_statuses
from mtnlg_lightning.resilience.restart_record import RESTART_RECORD_ENV

FORWARDED_SIGNALS = ("SIGTERM", "SIGUSR1")
CLEAN_END_GRACE_S = 120.0  # how long the rest of a group may take to end alike after one rank's clean end
RUN_ENDED_KEY = "mtnlg/run_ended"  # in the round's store: the exit code, for the spare nodes
log = logging.getLogger("mtnlg.launch")


class RunEndedElsewhere(Exception):
    """A spare node's end: the training nodes ended the run with `code`."""

    def __init__(self, code: int):
        super().__init__(f"the run ended on the training nodes: {describe(code)}")
        self.code = code


class ResilientAgent(ElasticAgent):
    """torchrun's local agent with the restart policy above (torch's steps it changes: `elastic_compat.py`)."""

    starts: list[dict] = []  # every start of the group on this node, with its cause: the summary at the end

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._failed_first: dict[int, int] = {}  # local rank -> exit code of the workers that failed by themselves
        self._clean_end_since: float | None = None  # when the first rank ended with a code that is not retried
        self._started = 0  # times this node started its workers (or waited as a spare)
        self._fault: dict = {}  # what this node saw of the last failure, for the next rendezvous
        self._nodes: dict[str, str] = {}  # node id -> host, of the last round
        self._attempt = 0
        self._spare = False
        self.status_dir = Path(tempfile.mkdtemp(prefix="mtnlg_status_"))
        os.environ[STATUS_DIR_ENV] = str(self.status_dir)
        self.node_id = f"{socket.gethostname()}:{os.getpid()}"

    # ------------------------------------------------------------------ every node agrees on each start
    def assign_worker_ranks(self, store, group_rank: int, group_world_size: int, spec):
        """Before torchrun numbers the ranks, the launchers of all nodes exchange their reports over this round's
        store and agree on the start (`elastic.agree`): its number and id, its cause, and which nodes train. A
        spare node offers no ranks, so the training ranks are numbered 0..N-1 on the nodes in front of it."""
        # torchrun's static rendezvous keeps one store over restarts (and its restart counts agree: no elastic nodes)
        static = spec.rdzv_handler.get_backend() == "static"
        prefix = f"mtnlg/{spec.max_restarts - self.remaining_restarts}/" if static else "mtnlg/"
        mine = {
            "node": self.node_id,
            "host": socket.gethostname(),
            "started": self._started,
            "id": uuid.uuid4().hex[:12],
            "fault": self._fault,
            "progress": self._progress() if self._started else {},
            "nodes_before": self._nodes,
            "rule": self._layout_rule(),
        }
        store.set(f"{prefix}agent/{group_rank}", json.dumps(mine))
        agents = [json.loads(store.get(f"{prefix}agent/{rank}")) for rank in range(group_world_size)]
        start = agree(agents, spec.local_world_size)
        self._attempt, self._nodes, self._fault = start["attempt"], start["nodes"], {}
        self._spare = group_rank >= start["training"]
        os.environ[ATTEMPT_ENV] = str(self._attempt)
        os.environ[ATTEMPT_ID_ENV] = start["attempt_id"]
        if self._attempt > 0:
            os.environ[RESTART_CAUSE_ENV] = start["cause"]
            os.environ[RESTART_RECORD_ENV] = json.dumps(start["record"])
        cause = start["cause"] if self._attempt else None
        self.starts.append({"attempt": self._attempt, "cause": cause, "nodes": len(agents), "spare": self._spare})
        if self._spare:
            print(
                f"mtnlg launch: {socket.gethostname()} waits as a spare: the layout trains on {start['training']} "
                f"of the {len(agents)} nodes",
                file=sys.stderr,
                flush=True,
            )
            offered = copy.copy(spec)
            offered.local_world_size = 0  # torchrun's own numbering then leaves this node out
            return super().assign_worker_ranks(store, group_rank, group_world_size, offered)
        return super().assign_worker_ranks(store, group_rank, group_world_size, spec)

    def _layout_rule(self) -> dict | None:
        """Which world sizes the run can use, from the status files this node's ranks wrote."""
        for attempt in range(self._attempt, -1, -1):
            for status in read_statuses(self.status_dir, attempt):
                rule = layout_rule(status.get("layout"))
                if rule:
                    return rule
        return None

    def start_workers(self, worker_group):
        self._started += 1
        if self._spare:
            self.forget_workers()  # no ranks here: monitor_workers waits for the end or the next rendezvous
            return {}
        started = super().start_workers(worker_group)
        # torchrun installs its own handlers when the workers start: forward ours instead, from then on.
        for name in FORWARDED_SIGNALS:
            signal.signal(getattr(signal, name), self._forward)
        return started

    def stop_workers(self, worker_group, *args, **kwargs):
        if worker_group.state == WorkerState.HEALTHY:  # a node joined: torchrun's restart of a healthy group
            self.shutdown(signal.SIGTERM, membership_restart_grace_s())
            return
        super().stop_workers(worker_group, *args, **kwargs)

    # ------------------------------------------------------------------ watching the ranks
    def monitor_workers(self, worker_group):
        if self._spare:
            return self._wait_as_a_spare(worker_group)
        codes = self._exit_codes()
        ended = {rank: code for rank, code in codes.items() if code not in (None, 0)}
        running = [rank for rank, code in codes.items() if code is None]
        clean_end = bool(ended) and run_exit_code(list(ended.values())) in NOT_RETRIED
        if ended and not clean_end:
            self._kill_peers_of_a_failed_worker(ended, running)
        if self._peers_of_a_clean_end_still_ending(clean_end and bool(running)):
            return RunResult(state=WorkerState.HEALTHY)  # not yet: torchrun's poll would SIGTERM them
        result = super().monitor_workers(worker_group)
        if result.is_failed():
            local_of = {w.global_rank: w.local_rank for w in worker_group.workers}
            own = self._failed_first or {local_of[g]: f.exitcode for g, f in result.failures.items()}
            self._failed_first = {}
            self._fault = self._describe_fault(worker_group, own)
            os.environ[RESTART_CAUSE_ENV] = "; ".join(f["text"] for f in self._fault["failures"])
            code = run_exit_code([f.exitcode for f in result.failures.values()])
            if code in NOT_RETRIED and self.remaining_restarts > 0:
                print(
                    f"mtnlg launch: {describe(code)}: not restarting ({os.environ[RESTART_CAUSE_ENV]})", file=sys.stderr
                )
                self.remaining_restarts = 0
            if self.remaining_restarts == 0:
                self._tell_the_spares(worker_group, int(code))
        elif result.state == WorkerState.SUCCEEDED:
            self._tell_the_spares(worker_group, int(ExitCode.FINISHED))
        return result

    def _tell_the_spares(self, worker_group, code: int) -> None:
        """The run ends here: the spare nodes, which wait for a restart that will not come, end too."""
        try:
            worker_group.store.set(RUN_ENDED_KEY, str(code))
        except Exception:  # noqa: BLE001 - the store's host may be gone with its node; the spares then time out
            pass

    def _wait_as_a_spare(self, worker_group) -> RunResult:
        """HEALTHY while the others train (torchrun restarts this node too when they meet again after a fault);
        when they end, end alike: a finished run meets them at torchrun's exit barrier."""
        if not worker_group.store.check([RUN_ENDED_KEY]):
            return RunResult(state=WorkerState.HEALTHY)
        code = int(worker_group.store.get(RUN_ENDED_KEY))
        if code == ExitCode.FINISHED:
            return RunResult(state=WorkerState.SUCCEEDED)
        raise RunEndedElsewhere(code)  # no rank failed here: torchrun has no result to say so

    def _describe_fault(self, worker_group, own: dict[int, int]) -> dict:
        """The ranks of this node that failed by themselves, with the phase and step their statuses last showed."""
        statuses = {s["local_rank"]: s for s in read_statuses(self.status_dir, self._attempt)}
        host = socket.gethostname()
        failures = []
        for local_rank, code in sorted(own.items()):
            status = statuses.get(local_rank, {})
            rank = worker_group.workers[local_rank].global_rank
            where = f" in {status['phase']} at step {status['step']}" if "phase" in status else ""
            failure = {"rank": rank, "host": host, "exit": code, "what": describe(code)}
            failure |= {"phase": status.get("phase"), "step": status.get("step")}
            failures.append(failure | {"text": f"rank {rank} on {host} {describe(code)}{where}"})
        return {"failures": failures}

    def _progress(self) -> dict:
        """How far this node's ranks got in the last start (`rank_status.py`): what a restart redoes and loses."""
        known = read_statuses(self.status_dir, self._attempt)
        return {
            "furthest_step": max((s.get("step", -1) for s in known), default=-1),
            "last_progress": max((s.get("last_beat", 0.0) for s in known), default=0.0),
            "mean_step_s": max((s.get("mean_step_s") or 0.0 for s in known), default=0.0),
            "layout_before": next((s["layout"] for s in known if s.get("layout")), None),
        }

    def _exit_codes(self) -> dict[int, int | None]:
        """local rank -> exit code, None while running."""
        return {rank: process.poll() for rank, process in self.worker_processes().items()}

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
        processes = self.worker_processes()
        for rank in running:
            processes[rank].kill()

    def _forward(self, signum, frame) -> None:
        for pid in self.worker_pids().values():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def membership_restart_grace_s() -> int:
    """How long a healthy group may take to end after the SIGTERM of a membership change: a step, then a save, each
    up to its limit (`MTNLG_STEP_TIMEOUT`, `MTNLG_SAVE_TIMEOUT` or the default caps). A rank that hangs meanwhile is
    ended sooner by its own watchdog; the group restarts as soon as every rank has ended."""
    limits = resolve_limits({phase: DEFAULT_CAPS[phase] for phase in ("step", "save")})
    return int(limits["step"] + limits["save"])


def summary(starts: list[dict], status_dir: Path | None) -> str | None:
    """The restarts of the run, one clause each, with what the restarted group's rank 0 recorded on this node
    (`restart_record.py`): `mtnlg launch: 2 restarts: 1: CAUSE; resumed from step 4, 1 step(s) redone, 14 s lost | 2:
    ...`."""
    restarts = [start for start in starts if start["attempt"] > 0]
    if not restarts:
        return None
    clauses, lost = [], 0.0
    for start in restarts:
        clause = f"{start['attempt']}: {start['cause']}"
        path = status_dir / f"attempt{start['attempt']}_restart.json" if status_dir else None
        if path is not None and path.exists():
            record = json.loads(path.read_text(encoding="utf-8"))
            clause += (
                f"; resumed from step {record['resumed_step']}" if record.get("resumed_from") else "; from scratch"
            )
            if record.get("steps_redone") is not None:
                clause += f", {record['steps_redone']} step(s) redone"
            if record.get("time_lost_s") is not None:
                clause += f", {record['time_lost_s']:.0f} s lost"
                lost += record["time_lost_s"]
            if record.get("layout_change"):
                clause += f"; {record['layout']['nodes']} node(s), dp {record['layout']['dp']}"
        clauses.append(clause)
    total = f" ({lost:.0f} s lost in all)" if lost else ""
    return f"mtnlg launch: {len(restarts)} restart{'s' if len(restarts) != 1 else ''}{total}: " + " | ".join(clauses)


def elastic(nnodes: str) -> bool:
    """`--nnodes MIN:MAX` with MIN < MAX: nodes may leave and join."""
    low, _, high = str(nnodes).partition(":")
    return bool(high) and low != high


def main(argv: list[str] | None = None) -> None:
    if not install_agent(ResilientAgent):
        raise SystemExit("mtnlg launch: error: this torch builds torchrun's agent elsewhere; use plain torchrun")
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] in (["-h"], ["--help"]):
        print(__doc__.strip() + "\n\nThe arguments are torchrun's:\n", flush=True)
    code = ExitCode.FINISHED
    options = parse_args(arguments)
    if elastic(options.nnodes):
        # torchrun shares its rendezvous store with the workers, but a node that joins a running job is never told
        # where that store is (reproduced: `DistStoreError: wait timeout ... MASTER_ADDR`, the grown group never
        # met), and its restart counts differ between nodes (pytorch issue 135712): with a node range, the workers
        # get a fresh store of their own at every start, as before torch 2.4.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        run(options)
    except ChildFailedError as error:
        code = run_exit_code([f.exitcode for f in error.failures.values()])
        print(f"mtnlg launch: run ended: {describe(int(code))}", file=sys.stderr)
    except RunEndedElsewhere as ended:
        code = run_exit_code([ended.code])
        print(f"mtnlg launch: spare node: {ended}", file=sys.stderr)
    status_dir = Path(os.environ[STATUS_DIR_ENV]) if os.environ.get(STATUS_DIR_ENV) else None
    line = summary(ResilientAgent.starts, status_dir)
    if line:
        print(line, file=sys.stderr, flush=True)
    if status_dir is not None:
        shutil.rmtree(status_dir, ignore_errors=True)  # the launcher's own temporary folder, read for the summary
    sys.exit(int(code))


if __name__ == "__main__":
    main()
