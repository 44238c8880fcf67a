"""Self-healing runs: exit codes, the launcher's restart policy, hang detection, stragglers, resume after a restart.

The distributed tests launch `mtnlg fit` as an operator would, under `python -m mtnlg_lightning.resilience.launch`
(torchrun with the restart policy); one launch serves several assertions to keep the suite short."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.resilience.exit_codes import ExitCode, describe, run_exit_code
from mtnlg_lightning.resilience.phase_limits import PHASES, PhaseLimits, resolve_limits
from mtnlg_lightning.resilience.restart_record import read_records
from mtnlg_lightning.resilience.watchdog import HangWatchdog
from testing.run_watch import RunWatch, alive

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_checkpoint_layouts import losses  # noqa: E402


def test_the_run_exit_code_is_the_most_telling_worker_code():
    assert run_exit_code([0, 0]) == ExitCode.FINISHED
    assert run_exit_code([2, -15]) == ExitCode.CONFIG_ERROR  # the others were stopped because of it
    assert run_exit_code([75, 0]) == ExitCode.PREEMPTED
    assert run_exit_code([124, 1]) == ExitCode.HANG  # the peers of a stuck rank crash on the closed connection
    assert run_exit_code([-9, 0]) == ExitCode.CRASH and run_exit_code([3]) == ExitCode.CRASH
    assert describe(-9) == "killed by SIGKILL" and describe(124) == "hang (exit 124)"


def test_environment_variables_override_the_configured_limits(monkeypatch):
    monkeypatch.setenv("MTNLG_STEP_TIMEOUT", "7.5")
    assert resolve_limits({"startup": 100, "step": 300, "save": 900}) == {"startup": 100, "step": 7.5, "save": 900}
    monkeypatch.setenv("MTNLG_SAVE_TIMEOUT", "soon")
    with pytest.raises(MTNLGError, match="MTNLG_SAVE_TIMEOUT must be a number of seconds"):
        resolve_limits({"save": 900})


def test_a_phase_starts_from_its_cap_then_learns_five_times_its_longest_interval_within_floor_and_cap(monkeypatch):
    for phase in PHASES:
        monkeypatch.delenv(f"MTNLG_{phase.upper()}_TIMEOUT", raising=False)
    monkeypatch.setenv("MTNLG_STEP_TIMEOUT", "100")
    limits = PhaseLimits()
    assert limits.limit("save") == 1800 and limits.limit("step") == 100  # not seen yet: the caps
    assert limits.how("save") == "not seen yet in this run: the cap"
    assert limits.cap("save") == "cap 1800 s, the default (MTNLG_SAVE_TIMEOUT sets it)"
    limits.observe("save", 0.4)
    limits.observe("save", 1.5)
    limits.observe("save", 0.9)
    assert limits.limit("save") == 30  # 5 x 1.5 s is below the floor
    assert limits.how("save") == "learned: 5 x the longest save seen (1.50 s), raised to the floor of 30 s"
    limits.observe("save", 200.0)
    assert limits.limit("save") == 1000  # 5 x the longest
    limits.observe("step", 40.0)
    assert limits.limit("step") == 100 and limits.how("step").endswith("held at the cap")
    assert limits.cap("step") == "cap 100 s from MTNLG_STEP_TIMEOUT"
    limits.observe("eval", 1.0)
    assert limits.limit("eval:downstream") == 600  # work of another size in a phase is learned apart
    assert "save 1000 s (longest 200.00 s)" in limits.summary()
    with pytest.raises(MTNLGError, match=r"floors name unknown phase\(s\) \['stepp'\]"):
        PhaseLimits(floors={"stepp": 1.0})


def test_learned_limits_travel_with_the_checkpoint_and_a_resuming_start_up_allows_for_the_load(monkeypatch):
    for phase in PHASES:
        monkeypatch.delenv(f"MTNLG_{phase.upper()}_TIMEOUT", raising=False)
    before = PhaseLimits()
    before.observe("startup", 40.0)
    before.observe("save", 60.0)
    before.observe("step", 2.0)
    after = PhaseLimits()
    after.observe("step", 3.0)
    after.load_state_dict(before.state_dict())
    assert after.longest == {"startup": 40.0, "save": 60.0, "step": 3.0}  # the longest of each, over both
    assert after.limit("startup:resuming") == 200 + 300  # the start-up's and the save's: it loads what was saved
    assert "plus the save limit (300 s)" in after.how("startup:resuming")
    after.observe("startup:resuming", 150.0)
    assert after.limit("startup:resuming") == 750  # once seen, learned like any other


class RecordedHangs(HangWatchdog):
    """The watchdog with its ending replaced: a hang is recorded and the watching stops (the real one exits 124)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.found: list[tuple[str, float, float, str]] = []

    def _fire(self, key, waited, step, limit):
        self.found.append((key, waited, limit, self.diagnosis(key, waited, step, limit)))
        self._stop.set()


def test_a_frozen_rank_is_found_within_the_learned_limit_of_its_phase_save_and_evaluation_included(monkeypatch):
    """The heartbeats of a short run (steps, data waits, a save, a validation), then no heartbeat at all in a save,
    and again in a validation: each time the watchdog reports within that phase's learned limit, not its cap."""
    from types import SimpleNamespace

    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "MTNLG_ATTEMPT", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    trainer = SimpleNamespace(global_rank=0, local_rank=0, global_step=0, checkpoint_callbacks=[], is_global_zero=True)
    floors = {phase: 0.3 for phase in PHASES}

    def short_run(watchdog):
        for step in range(3):
            trainer.global_step = step
            watchdog.on_train_batch_start(trainer, None, None, step)
            time.sleep(0.05)
            watchdog.on_train_batch_end(trainer, None, None, None, step)
        watchdog.on_save_checkpoint(trainer, None, {})
        time.sleep(0.1)
        watchdog.on_validation_start(trainer, None)
        for batch in range(2):
            time.sleep(0.05)
            watchdog.on_validation_batch_end(trainer, None, None, None, batch)
        watchdog.on_validation_end(trainer, None)

    for freeze in ("save", "eval"):
        watchdog = RecordedHangs(save_timeout=600, eval_timeout=600, floors=floors, safety_factor=3, poll_interval=0.02)
        watchdog.setup(trainer, None, "fit")
        short_run(watchdog)
        frozen = time.monotonic()
        if freeze == "save":
            watchdog.on_save_checkpoint(trainer, None, {})  # and no heartbeat after it
        else:
            watchdog.on_validation_start(trainer, None)
        RunWatch(ceiling_s=60).until(lambda w=watchdog: w.found, f"the watchdog in {freeze}")  # nothing to watch
        found_after = time.monotonic() - frozen
        watchdog.stop()
        ((key, waited, limit, diagnosis),) = watchdog.found
        assert key == freeze and limit == watchdog.limits.limit(freeze) < 600  # learned, not the cap
        assert limit <= waited < limit + 0.5 and found_after < limit + 0.5
        assert f"no progress in {freeze} for" in diagnosis and f"learned: 3 x the longest {freeze} seen" in diagnosis


def test_a_restart_is_accounted_for_in_one_log_line_and_one_restarts_jsonl_line(tmp_path, monkeypatch, capsys):
    """Rank 0 of the restarted group, from what the launcher gathered (exit codes, hosts, the node that did not
    come back) and what the ranks of the attempt before left in their status files (phase, step, last progress)."""
    import json
    from types import SimpleNamespace

    from mtnlg_lightning.resilience.rank_status import write_status
    from mtnlg_lightning.resilience.restart_record import report_restart

    now = time.time()
    layout_before = {
        "world": 2,
        "nodes": 2,
        "dp": 2,
        "tp": 1,
        "pp": 1,
        "global_batch": 8,
        "micro_batches_per_replica": 2,
    }
    status = {"rank": 0, "local_rank": 0, "host": "node1", "phase": "save", "step": 6, "last_beat": now - 40}
    write_status(tmp_path / "status", 1, 0, status | {"mean_step_s": 2.0, "layout": layout_before})
    failure = {"rank": 0, "host": "node1", "exit": 124, "what": "hang (exit 124)", "phase": "save", "step": 6}
    launcher = {"failures": [failure], "lost_hosts": ["node2"], "furthest_step": 7, "last_progress": now - 30}
    monkeypatch.setenv("MTNLG_STATUS_DIR", str(tmp_path / "status"))
    monkeypatch.setenv("MTNLG_ATTEMPT", "2")
    monkeypatch.setenv("MTNLG_RESTART_CAUSE", "rank 0 on node1 hang (exit 124) in save at step 6; node node2 lost")
    monkeypatch.setenv("MTNLG_RESTART_RECORD", json.dumps(launcher))
    checkpoint = complete_checkpoint(tmp_path / "ckpt" / "step=4.ckpt", 4)
    schedule = SimpleNamespace(batch_size_at_samples=lambda _: 8, global_batch_size=8, rampup_increment=None)
    module = SimpleNamespace(batch_schedule=schedule, micro_batch_size=2)
    trainer = SimpleNamespace(
        world_size=1, num_devices=1, strategy=SimpleNamespace(), lightning_module=module, is_global_zero=True,
        global_step=4, ckpt_path=str(checkpoint),
    )  # fmt: skip
    report_restart(trainer, [tmp_path / "elsewhere"])
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("restart 2: resumed from step 4 (rank 0 on node1 hang (exit 124) in save")
    assert "; 3 steps redone, " in out  # it had reached step 7
    assert "layout changed: now 1 node(s), 1 ranks = dp 1 x tp 1 x pp 1, was 2 node(s)" in out
    assert "node2 did not come back" in out and "global batch stays 8, 4 micro-batch(es) per replica" in out
    (record,) = read_records(tmp_path / "ckpt")  # beside the checkpoint it resumed
    assert record["failures"] == [failure] and record["lost_hosts"] == ["node2"]
    assert record["resumed_step"] == 4 and record["steps_redone"] == 3 and record["furthest_step"] == 7
    assert 30 <= record["downtime_s"] < 60 and record["time_lost_s"] == pytest.approx(record["downtime_s"] + 6, 0.01)
    report_restart(trainer, [])
    assert len(read_records(tmp_path / "ckpt")) == 2  # appended


def test_a_run_trains_on_the_most_nodes_its_layout_can_use_and_keeps_the_others_as_spares():
    from mtnlg_lightning.resilience.elastic import agree, usable_nodes

    mtnlg_530b = {"replica_ranks": 8 * 35, "micro_batch": 1, "batch_sizes": [1920]}  # after the batch ramp
    assert usable_nodes(560, 8, mtnlg_530b) == 560 and usable_nodes(559, 8, mtnlg_530b) == 525  # DP 15
    during_the_ramp = mtnlg_530b | {"batch_sizes": [32, 1920]}
    assert usable_nodes(559, 8, during_the_ramp) == 280  # DP 8: DP must divide 32
    tiny = {"replica_ranks": 1, "micro_batch": 2, "batch_sizes": [8]}
    assert [usable_nodes(n, 1, tiny) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 4, 4]
    assert usable_nodes(3, 1, None) == 3  # the rule unknown (no rank started yet): every node trains

    def agent(node, started, fault=None, before=None, rule=None):
        progress = {"furthest_step": 7, "last_progress": 100.0, "mean_step_s": 1.0, "layout_before": None}
        return {"node": node, "host": node.split(":")[0], "started": started, "id": f"id{node}", "fault": fault,
                "progress": progress, "nodes_before": before or {}, "rule": rule}  # fmt: skip

    failure = {"rank": 1, "host": "b", "exit": -9, "what": "killed by SIGKILL", "phase": "save", "step": 7}
    before = {"a:1": "a", "b:2": "b", "c:3": "c"}
    start = agree(
        [
            agent("a:1", 2, before=before, rule=tiny),
            agent("c:3", 2, {"failures": [failure | {"text": "rank 1 on c killed by SIGKILL in save"}]}, before),
            agent("d:4", 0),
        ],
        ranks_per_node=1,
    )
    assert start["attempt"] == 2 and start["attempt_id"] == "2_ida:1" and start["training"] == 2
    assert start["spares"] == ["d"] and start["record"]["spare_hosts"] == ["d"]
    assert start["cause"] == "rank 1 on c killed by SIGKILL in save; node b lost: it did not come back to the " \
        "rendezvous; node d joined"  # fmt: skip
    assert start["record"]["failures"] == [failure] and start["record"]["furthest_step"] == 7


def test_a_node_joining_gives_the_running_ranks_a_step_and_a_save_to_end_where_torchrun_gives_30_s(monkeypatch):
    """torchrun restarts a healthy group when a node joins: SIGTERM, then SIGKILL after 30 s. The ranks save on the
    SIGTERM (`Preemption`), which takes minutes on a large model; killed in it, they would redo every step since the
    last periodic save. A failed group is stopped as torchrun does (its ranks cannot save: they lost a peer)."""
    from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec, WorkerState

    from mtnlg_lightning.resilience.launch import ResilientAgent

    class Processes:
        def close(self, death_sig, timeout):
            self.closed = (death_sig, timeout)

    agent = object.__new__(ResilientAgent)  # the stop alone: no rendezvous, no workers
    agent._worker_watchdog = agent._health_check_server = None
    group = WorkerGroup(WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=None, entrypoint="python"))
    monkeypatch.setenv("MTNLG_STEP_TIMEOUT", "60")
    monkeypatch.setenv("MTNLG_SAVE_TIMEOUT", "600")
    for state, grace in ((WorkerState.HEALTHY, 660), (WorkerState.FAILED, 30)):
        agent._pcontext, group.state = Processes(), state
        agent._stop_workers(group)
        assert agent._pcontext.closed == (signal.SIGTERM, grace), state
    monkeypatch.delenv("MTNLG_SAVE_TIMEOUT")
    agent._pcontext, group.state = Processes(), WorkerState.HEALTHY
    agent._stop_workers(group)
    assert agent._pcontext.closed == (signal.SIGTERM, 60 + 1800)  # the save's default cap: a 530B save


def complete_checkpoint(path: Path, step: int) -> Path:
    from mtnlg_lightning.checkpoint.commit import prepare_staging, publish
    from mtnlg_lightning.checkpoint.format import Piece, write_manifest, write_pieces

    staging = prepare_staging(path)
    written = write_pieces(staging, "rank-00000.safetensors", [Piece("w", torch.ones(2), (0,), (2,))])
    write_manifest(staging, [written], {"global_step": step})
    publish(staging, path)
    return path


def test_last_is_the_newest_complete_checkpoint_of_every_folder_and_a_restart_needs_no_path(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from mtnlg_lightning.checkpoint.commit import prepare_staging
    from mtnlg_lightning.resilience.restart import resolve_ckpt_path

    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    user, root = tmp_path / "user", tmp_path / "root"
    old = complete_checkpoint(user / "epoch=0-step=2.ckpt", 2)
    complete_checkpoint(root / "checkpoints" / "step=4.ckpt", 4)  # a preemption save, outside the callback's folder
    prepare_staging(user / "epoch=0-step=6.ckpt").joinpath("rank-00000.safetensors").write_bytes(b"half")  # killed
    callback = SimpleNamespace(dirpath=str(user))
    trainer = SimpleNamespace(checkpoint_callbacks=[callback], default_root_dir=str(root), loggers=[])
    newest = str(root / "checkpoints" / "step=4.ckpt")
    assert resolve_ckpt_path(trainer, "last") == newest
    assert resolve_ckpt_path(trainer, None) is None and resolve_ckpt_path(trainer, str(old)) == str(old)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted attempt resumes by itself
    assert resolve_ckpt_path(trainer, None) == newest
    assert resolve_ckpt_path(trainer, str(old)) == newest  # not the first attempt's starting point again
    later = complete_checkpoint(tmp_path / "elsewhere" / "step=9.ckpt", 9)
    assert resolve_ckpt_path(trainer, str(later)) == str(later)


# ------------------------------------------------------------------------------------------------ under the launcher
def launch(
    args: list[str], log: Path, max_restarts: int, env: dict | None = None, entry=("-m", "mtnlg_lightning.train.cli")
) -> subprocess.Popen:
    command = [sys.executable, "-m", "mtnlg_lightning.resilience.launch", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", str(max_restarts), "--monitor-interval", "0.2", *entry, *args]
    return start(command, log, env)


def start(command: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])  # testing.fault_probe
    full_env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": pythonpath, **(env or {})}
    for name in ("MTNLG_STARTUP_TIMEOUT", "MTNLG_STEP_TIMEOUT", "MTNLG_DATA_TIMEOUT", "MTNLG_SAVE_TIMEOUT"):
        if name not in (env or {}):
            full_env.pop(name, None)  # only what the test sets
    handle = open(log, "w")  # noqa: SIM115
    return subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=handle, stderr=subprocess.STDOUT)


def ranks_report(probe: Path, ranks: int) -> str:
    """What the probe says of each rank, for a failed wait: its pid, alive or not, its last finished step."""
    lines = []
    for rank in range(ranks):
        try:
            pid = int((probe / f"rank{rank}.pid").read_text())
        except (FileNotFoundError, ValueError):
            lines.append(f"rank {rank}: no pid written yet")
            continue
        steps = [s for p, s in probed(probe, rank) if p == pid]
        state = "alive" if alive(pid) else "gone"
        lines.append(f"rank {rank}: pid {pid} {state}, last step {steps[-1] if steps else None} in this attempt")
    return "\n".join(lines)


def probed(probe: Path, rank: int, what: str = "steps") -> list[tuple[int, int]]:
    """(pid, step) lines a rank's Probe wrote: its finished steps, or the evaluations it started."""
    try:
        lines = (probe / f"rank{rank}.{what}").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [(int(p), int(s)) for p, s in (line.split() for line in lines if line.count(" ") == 1)]


def running_group(
    probe: Path, ranks: int, steps: int, not_pids=(), after_unsaved: bool = False
) -> dict[int, int] | None:
    """rank -> pid of a group whose every rank has finished `steps` steps in this attempt, none of `not_pids`;
    `after_unsaved`: and its newest finished step is not one the checkpoint cadence saves (its save is not running)."""
    pids = {}
    for rank in range(ranks):
        try:
            pids[rank] = int((probe / f"rank{rank}.pid").read_text())
        except (FileNotFoundError, ValueError):
            return None
        done = [s for p, s in probed(probe, rank) if p == pids[rank]]
        if pids[rank] in not_pids or len(done) < steps or (after_unsaved and done[-1] % SAVE_EVERY == 0):
            return None
    return pids


def hold(probe: Path, group: dict[int, int]) -> None:
    """Hold `group` (rank -> pid) at its next step boundary until its launcher stops it for a membership change
    (testing/fault_probe.py): the run cannot finish before the node the drill starts next has joined."""
    newest = max(s for rank, pid in group.items() for p, s in probed(probe, rank) if p == pid)
    (probe / "hold").write_text(" ".join(str(n) for n in (newest, *group.values())))


def all_losses(save_dir: Path) -> list[dict[int, float]]:
    """train_loss by step of each attempt (CSVLogger writes one `version_N` per start)."""
    by_version = sorted(save_dir.rglob("metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1]))
    return [losses(path.parent) for path in by_version]


def assert_losses_equal(attempts: list[dict[int, float]], reference: dict[int, float], rel: float) -> None:
    merged = {step: loss for attempt in attempts for step, loss in attempt.items()}
    assert sorted(merged) == sorted(reference), (sorted(merged), sorted(reference))
    for attempt in attempts:
        for step, loss in attempt.items():  # every logged loss, redone steps included
            assert loss == pytest.approx(reference[step], rel=rel), (step, loss, reference[step])


STEPS, SAVE_EVERY, EVAL_EVERY = 16, 2, 4
# pytest-timeout of a watched drill: above the waits' ceiling (testing/run_watch.py, 1500 s from each watch's start),
# so that a run that stalls or overruns fails in its wait, with what it was doing, not in pytest-timeout's stack dump
WATCHED = 2400
ZERO1_DP2 = ["--trainer.strategy", "configs/strategy/zero1.yaml"]


def run_args(save_dir: Path, devices: int) -> list[str]:
    """The tiny config on ZeRO-1, 16 steps, a validation every 4: the uninterrupted run and the faulted ones."""
    args = ["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", str(STEPS), *ZERO1_DP2]
    args += ["--trainer.devices", str(devices), "--trainer.val_check_interval", str(EVAL_EVERY)]
    return args + [
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir",
        str(save_dir),
    ]


def step_of(checkpoint: Path) -> int:
    return int(re.search(r"step=(\d+)", checkpoint.name)[1])


def torchrun(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *arguments]


@pytest.fixture(scope="module")
def uninterrupted_dp2(tmp_path_factory) -> dict[int, float]:
    """Per-step losses of the run without faults: 2 ranks (dp 2), global batch 8."""
    work = tmp_path_factory.mktemp("uninterrupted")
    command = torchrun("--standalone", "--nproc-per-node", "2", "-m", "mtnlg_lightning.train.cli", *run_args(work, 2))
    job = start(command, work / "log")
    watch = RunWatch({"torchrun": (job, work / "log")}, progress=[work])
    assert watch.finish("torchrun") == 0, (work / "log").read_text()[-3000:]
    (reference,) = all_losses(work)
    return reference


@pytest.mark.distributed
@pytest.mark.timeout(WATCHED)
def test_plain_torchrun_heals_a_kill_after_a_save_stops_during_a_save_and_a_step_and_a_kill_in_an_evaluation(
    tmp_path, uninterrupted_dp2
):
    """2-rank ZeRO-1 under plain `torchrun --max-restarts 4`, only MTNLG_STEP_TIMEOUT set, 16 steps, a checkpoint
    (Lightning's own ModelCheckpoint) every 2, a validation every 4; rank 1 slowed (a straggler). Four faults, each
    in the group the one before restarted: kill -9 after a save; SIGSTOP during a save (each write held 1 s), which
    its peer finds within the save limit the run learned (under a minute; the save's cap is 30 minutes); SIGSTOP
    during a step, found within the step limit; kill -9 during a validation (each batch held 1 s). The run finishes
    by itself, every logged loss equal to the uninterrupted run's, and each restart is accounted for."""
    ckpt, probe, log, step_limit = tmp_path / "ckpt", tmp_path / "probe", tmp_path / "log", 10.0
    args = run_args(tmp_path, 2) + ["--trainer.enable_checkpointing", "true", "--model.straggler_every_n_steps", "2"]
    args += ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", "--trainer.callbacks.dirpath"]
    args += [str(ckpt), "--trainer.callbacks.every_n_train_steps", str(SAVE_EVERY)]
    args += ["--trainer.callbacks.save_top_k", "-1", "--trainer.callbacks+=testing.fault_probe.Probe"]
    args += ["--trainer.callbacks.dir", str(probe), "--trainer.callbacks.slow_rank", "1"]
    args += ["--trainer.callbacks.slow_s", "0.3", "--trainer.callbacks.slow_eval_s", "1.0", "--ckpt_path", "last"]
    held_writes = (str(ROOT / "testing" / "slow_checkpoint_writes.py"), "1.0")
    arguments = ("--standalone", "--nproc-per-node", "2", "--max-restarts", "4", "--monitor-interval", "0.2")
    job = start(torchrun(*arguments, *held_writes, *args), log, {"MTNLG_STEP_TIMEOUT": str(step_limit)})
    watch = RunWatch({"torchrun": (job, log)}, progress=[probe, ckpt], describe=lambda: ranks_report(probe, 2))

    def published() -> set[int]:
        return {step_of(p) for p in ckpt.glob("*.ckpt") if (p / "manifest.json").exists()}

    try:
        # 1. kill -9 after a save
        first = watch.until(lambda: running_group(probe, 2, 3), "the first group's step 3")
        watch.until(lambda: published(), "the first checkpoint")
        os.kill(first[1], signal.SIGKILL)
        # 2. SIGSTOP during a save, once the restarted group has seen a save of its own
        second = watch.until(lambda: running_group(probe, 2, 1, not_pids=first.values()), "the second group")
        seen = published()
        watch.until(lambda: published() - seen, "a save of the second group")
        seen = max(published())
        watch.until(lambda: [p for p in ckpt.glob(".*.incomplete") if step_of(p) > seen], "the next save")
        time.sleep(0.3)  # inside the held write
        os.kill(second[1], signal.SIGSTOP)
        stopped = time.monotonic()
        watch.until(lambda: not alive(second[0]), "rank 0 to find the stop during the save")
        found_in_save = time.monotonic() - stopped
        # 3. SIGSTOP during a step: after an odd step, in the next one, the one before a save (rank 1 sleeps 0.3 s
        # at its start). Rank 0 waits for it in the step's all-reduce, or, if the stop lands before the collective
        # Lightning runs between two steps, in that one: the data phase, with its own limit.
        third = watch.until(lambda: running_group(probe, 2, 2, not_pids=second.values()), "group 3")
        watch.until(lambda: max(s for p, s in probed(probe, 1) if p == third[1]) % 2, "an odd step of group 3")
        time.sleep(0.1)
        os.kill(third[1], signal.SIGSTOP)
        stopped = time.monotonic()
        watch.until(lambda: not alive(third[0]), "rank 0 to find the stop during a step")
        found_in_step = time.monotonic() - stopped
        # 4. kill -9 during a validation
        fourth = watch.until(lambda: running_group(probe, 2, 1, not_pids=third.values()), "group 4")
        watch.until(lambda: [p for p, _ in probed(probe, 1, "evals") if p == fourth[1]], "a validation of group 4")
        time.sleep(0.3)  # inside its first held batch
        os.kill(fourth[1], signal.SIGKILL)
        assert watch.finish("torchrun") == 0, log.read_text()[-4000:]
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    print(f"stop during a save found after {found_in_save:.1f} s, during a step after {found_in_step:.1f} s")
    found = r"mtnlg watchdog: rank 0 on .*: no progress in (\w+) for \d+ s at step \d+ \(limit (\d+) s, (.*)\)"
    (save, limit, how), (phase, step_phase_limit, step_how) = re.findall(found, text)
    assert save == "save" and int(limit) <= 30 and found_in_save < 60, (found_in_save, text[-3000:])
    assert how.startswith("learned: 5 x the longest save seen") and how.endswith("(MTNLG_SAVE_TIMEOUT sets it)"), how
    if phase == "step":
        assert step_phase_limit == "10" and step_how.endswith("held at the cap; cap 10 s from MTNLG_STEP_TIMEOUT")
    else:
        assert phase == "data" and int(step_phase_limit) <= 30 and step_how.startswith("learned: 5 x"), step_how
    assert found_in_step < int(step_phase_limit) + 5, (found_in_step, text[-3000:])
    assert "mtnlg watchdog: waiting in torch.distributed." in text and "(most recent call first)" in text
    assert "connectFullMesh" not in text  # every restarted group met again at the first try
    assert re.search(rf"straggler: rank 1 on {re.escape(socket.gethostname())} took", text), text[-3000:]
    restarts = re.findall(r"restart (\d+): resumed from step (\d+) \((.*)\)", text)
    assert [int(k) for k, _, _ in restarts] == [1, 2, 3, 4], text[-4000:]
    saved = sorted(step_of(p) for p in ckpt.glob("*.ckpt"))
    assert all(int(step) in saved for _, step, _ in restarts)
    assert not [p.name for p in ckpt.iterdir() if "-v" in p.name]  # no second copy of a step
    assert_losses_equal(all_losses(tmp_path / "lightning_logs"), uninterrupted_dp2, rel=1e-4)
    from mtnlg_lightning.checkpoint.format import read_meta

    (last,) = [p for p in ckpt.glob("*.ckpt") if step_of(p) == STEPS]
    learned = read_meta(last)["callbacks"]["HangWatchdog"]["limits"]["longest"]
    assert {"startup", "step", "data", "save", "eval"} <= set(learned)  # the learned limits travel with it
    records = read_records(ckpt)
    assert [r["restart"] for r in records] == [1, 2, 3, 4]
    assert "hang in save" in records[1]["cause"] and f"hang in {phase}" in records[2]["cause"]
    assert all(r["steps_redone"] is not None and r["time_lost_s"] > 0 for r in records)


def free_port() -> int:
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        return probe_socket.getsockname()[1]


def rendezvous_port(command: list[str]) -> int:
    return int(command[command.index("--rdzv-endpoint") + 1].rsplit(":", 1)[1])


def listening(port: int) -> bool:
    with socket.socket() as client:
        return client.connect_ex(("127.0.0.1", port)) == 0


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def elastic_node(work: Path, last_call_s: float, slow_s: float = 0.0, nodes: str = "1:2") -> list[str]:
    """One simulated node of one rank: `mtnlg-launch --nnodes 1:2` of the tiny run, checkpoints every 2 steps, rank
    0 slowed by `slow_s` a step."""
    args = run_args(work, 1) + ["--trainer.enable_checkpointing", "true"]
    args += ["--trainer.callbacks+=callbacks/checkpoint.yaml", "--trainer.callbacks.dirpath", str(work / "ckpt")]
    args += ["--trainer.callbacks.every_n_train_steps", str(SAVE_EVERY)]
    args += ["--trainer.callbacks+=testing.fault_probe.Probe", "--trainer.callbacks.dir", str(work / "probe")]
    args += ["--trainer.callbacks.slow_rank", "0", "--trainer.callbacks.slow_s", str(slow_s)]
    node = [sys.executable, "-m", "mtnlg_lightning.resilience.launch", "--nnodes", nodes, "--nproc-per-node", "1"]
    node += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", work.name]
    # how long a rendezvous with enough nodes waits for more (torchrun's default: 30 s)
    node += ["--rdzv-conf", f"last_call_timeout={last_call_s:g}", "--max-restarts", "2", "--monitor-interval", "0.2"]
    return [*node, "-m", "mtnlg_lightning.train.cli", *args, "--ckpt_path", "last"]


@pytest.mark.distributed
@pytest.mark.timeout(WATCHED)
def test_a_run_that_loses_a_node_for_good_goes_on_with_fewer_replicas_and_the_losses_of_the_uninterrupted_run(
    tmp_path, uninterrupted_dp2
):
    """`mtnlg-launch --nnodes 1:2` on two simulated nodes of one rank each (dp 2, ZeRO-1, global batch 8), the first
    hosting the rendezvous (which waits 10 s for more nodes). The second node (its launcher and its rank) is killed
    after step 5 and never comes back: the first node's launcher meets the rendezvous alone, its rank resumes from
    the newest checkpoint at dp 1 with 4 micro-batches per step instead of 2, and the run finishes with every step's
    loss equal to the uninterrupted dp-2 run's. The log says what changed, once; restarts.jsonl records the lost
    node and both layouts; the launcher sums the restart up."""
    ckpt, probe = tmp_path / "ckpt", tmp_path / "probe"
    node = elastic_node(tmp_path, last_call_s=10)
    first = start(node, tmp_path / "node1.log")
    watch = RunWatch(progress=[probe, ckpt], describe=lambda: ranks_report(probe, 2))
    watch.add("node1", first, tmp_path / "node1.log")
    watch.until(lambda: listening(rendezvous_port(node)), "the first node to host the rendezvous")
    second = start(node, tmp_path / "node2.log")  # the node lost below: it must not be the rendezvous host
    watch.add("node2", second, tmp_path / "node2.log")
    try:
        ranks = watch.until(lambda: running_group(probe, 2, 5), "step 5 on both nodes")
        (lost,) = [pid for pid in ranks.values() if parent_of(pid) == second.pid]
        second.kill()
        watch.stopped("node2")
        os.kill(lost, signal.SIGKILL)
        assert watch.finish("node1") == 0, (tmp_path / "node1.log").read_text()[-4000:]
    finally:
        for job in (first, second):
            if job.poll() is None:
                job.kill()
    log = (tmp_path / "node1.log").read_text()
    assert_losses_equal(all_losses(tmp_path / "lightning_logs"), uninterrupted_dp2, rel=1e-5)
    (record,) = read_records(ckpt)
    assert record["lost_hosts"] == [socket.gethostname()] and f"node {socket.gethostname()} lost" in record["cause"]
    assert record["layout_before"]["dp"] == 2 and record["layout_before"]["micro_batches_per_replica"] == 2
    assert record["layout"] == record["layout"] | {"world": 1, "nodes": 1, "dp": 1, "micro_batches_per_replica": 4}
    assert record["resumed_step"] >= 4 and Path(record["resumed_from"]).parent == ckpt
    assert log.count("layout changed: now 1 node(s), 1 ranks = dp 1 x tp 1 x pp 1, was 2 node(s)") == 1, log[-3000:]
    assert "the global batch stays 8, 4 micro-batch(es) per replica per step (was 2)" in log
    summary = re.search(r"mtnlg launch: 1 restart \(\d+ s lost in all\): 1: .*; resumed from step \d+.*", log)
    assert summary, log[-2000:]
    print(summary.group(0))  # the time lost, quoted by the runbook (pytest -rA shows it)


@pytest.mark.distributed
@pytest.mark.timeout(WATCHED)
def test_a_run_grows_back_when_nodes_join_keeps_a_node_its_layout_cannot_use_as_a_spare_and_the_spare_takes_over(
    tmp_path, uninterrupted_dp2
):
    """Three simulated nodes of one rank (`mtnlg-launch --nnodes 1:3`), the tiny run slowed to ~1 s a step: node A
    trains alone (dp 1, 4 micro-batches per step); node B joins, and the run grows to dp 2 (A's rank saves on the
    launcher's SIGTERM and exits; both resume from that save); node C joins, but 3 replicas cannot share a batch of
    4 micro-batches: one node (the rendezvous picks which) waits as a spare, the others go on at dp 2; a training
    node other than A (the rendezvous host) is then killed for good, and the spare takes its place. Every loss
    equals the uninterrupted dp-2 run's; restarts.jsonl tells each start's story. Before B and before C starts, the
    group that runs is held at its next step boundary until the join stops it (the probe's `hold`), so that a slow
    start-up on a loaded machine cannot let the run finish first."""
    probe, node = tmp_path / "probe", elastic_node(tmp_path, last_call_s=2, slow_s=1.0, nodes="1:3")
    logs = {name: tmp_path / f"node_{name}.log" for name in "ABC"}
    jobs = {"A": start(node, logs["A"])}
    watch = RunWatch(progress=[probe, tmp_path / "ckpt"], describe=lambda: ranks_report(probe, 2))
    watch.add("A", jobs["A"], logs["A"])
    try:
        alone = watch.until(lambda: running_group(probe, 1, 2), "node A alone at step 2")
        hold(probe, alone)  # until B has joined: B's start-up may outlast the run's 16 steps on a loaded machine
        jobs["B"] = watch.add("B", start(node, logs["B"]), logs["B"])
        pair = watch.until(lambda: running_group(probe, 2, 1, not_pids=alone.values()), "A and B together")
        hold(probe, pair)  # until C has joined
        jobs["C"] = watch.add("C", start(node, logs["C"]), logs["C"])
        watch.until(lambda: any("waits as a spare" in log.read_text() for log in logs.values()), "a spare")
        (spare,) = [name for name, log in logs.items() if "waits as a spare" in log.read_text()]
        # after a step that is not saved, so that the kill below lands in a step (rank 0 sleeps 1 s before each),
        # not in a save: a rank killed in one can leave a complete checkpoint whose step's loss was never logged
        # (Lightning logs a step after its checkpoint callbacks) and that no restart redoes (seen: "rank 0 crash in
        # save at step 8", step 7's loss missing)
        in_a_step = lambda: running_group(probe, 2, 1, not_pids=pair.values(), after_unsaved=True)  # noqa: E731
        pair_again = watch.until(in_a_step, "the pair, again")
        # a training node, not A: A hosts the rendezvous (torchrun's c10d rendezvous ends with its host)
        other = next(name for name in "BC" if name != spare)
        (lost,) = [pid for pid in pair_again.values() if parent_of(pid) == jobs[other].pid]
        jobs[other].kill()
        watch.stopped(other)
        os.kill(lost, signal.SIGKILL)
        for name in sorted(set("ABC") - {other}):
            assert watch.finish(name) == 0, logs[name].read_text()[-4000:]
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
    assert_losses_equal(all_losses(tmp_path / "lightning_logs"), uninterrupted_dp2, rel=1e-5)
    grew, spared, replaced = read_records(tmp_path / "ckpt")
    host = socket.gethostname()
    assert grew["cause"] == f"node {host} joined" and grew["steps_redone"] == 0
    assert (grew["layout_before"]["dp"], grew["layout"]["dp"]) == (1, 2) and "grows" in grew["layout_change"]
    assert spared["cause"] == f"node {host} joined" and spared["spare_hosts"] == [host]
    assert spared["layout"]["dp"] == 2 and spared["layout_change"] is None  # the same layout: C waits
    assert f"node {host} lost" in replaced["cause"] and replaced["spare_hosts"] == [] and replaced["layout"]["dp"] == 2
    assert "mtnlg launch: 3 restarts" in logs["A"].read_text()


@pytest.mark.distributed
@pytest.mark.timeout(WATCHED)
def test_a_configuration_error_exits_once_with_its_code_and_is_not_restarted_even_when_rank_0_is_last(tmp_path):
    """Rank 1 fails first; torchrun alone would SIGTERM rank 0, the rank that prints the error, before it gets there."""
    args = ["fit", "--config", "configs/tiny.yaml", "--trainer.strategy", "configs/strategy/zero1.yaml"]
    args += ["--trainer.devices", "2", "--trainer.strategy.zero_stage", "7"]
    late_rank_zero = (str(Path(__file__).parent / "late_rank_zero.py"), "5")
    job = launch(args, tmp_path / "log", max_restarts=3, entry=late_rank_zero)
    assert RunWatch({"launcher": (job, tmp_path / "log")}).finish("launcher") == ExitCode.CONFIG_ERROR
    log = (tmp_path / "log").read_text()
    assert log.count("mtnlg: error: zero_stage 7 is not one of") == 1, log[-3000:]  # one attempt, one line
    assert "not restarting" in log and "will restart worker group" not in log, log[-3000:]


# ------------------------------------------------------------------------------------------------ background saves
def test_a_background_save_that_fails_on_bad_input_or_a_full_disk_fails_as_a_foreground_save_would():
    """A user's error (MTNLGError) or the machine's (OSError) reaches the training thread as itself (one line from
    errors.run_main); anything else is a bug, raised with its cause."""
    from mtnlg_lightning.checkpoint.async_save import BackgroundSaver

    def failing(error):
        def write():
            raise error

        return write

    saver = BackgroundSaver(group=None)
    for error, raised in ((MTNLGError("bad checkpoint path"), MTNLGError), (OSError(28, "No space left"), OSError)):
        saver.submit(failing(error))
        with pytest.raises(raised) as got:
            saver.wait()
        assert got.value is error
    saver.submit(failing(KeyError("slot")))
    with pytest.raises(RuntimeError, match="background checkpoint save failed"):
        saver.wait()


@pytest.mark.slow
def test_a_background_save_writes_the_state_of_its_step_while_training_changes_it(tmp_path, monkeypatch):
    """ZeRO-1, one rank: the background save returns before its (held) write, every weight, master weight and
    Adam moment is then changed in place, as the next steps would; the published checkpoint still holds the saved
    step's state, bit for bit as a synchronous save of it."""
    from safetensors.torch import load_file

    from mtnlg_lightning.checkpoint import format as checkpoint_format
    from mtnlg_lightning.checkpoint.format import is_checkpoint
    from mtnlg_lightning.parallel.zero import base_optimizer
    from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy
    from testing.parallel_harness import tiny_run
    from testing.slow_checkpoint_writes import slowed

    strategy = MegatronDeepSpeedStrategy(zero_stage=1, print_layout=False, async_save=True)
    _, trainer = tiny_run(strategy=strategy, max_steps=2, capture_steps=())
    saver, strategy.background_saver = strategy.background_saver, None
    trainer.save_checkpoint(tmp_path / "sync.ckpt")
    strategy.background_saver = saver
    monkeypatch.setattr(
        checkpoint_format, "save_file", slowed(checkpoint_format.save_file, 3)
    )  # the writer holds 3 s before writing
    started = time.monotonic()
    trainer.save_checkpoint(tmp_path / "background.ckpt")
    stall = time.monotonic() - started
    inner = base_optimizer(strategy.engine.optimizer)
    live = [*trainer.lightning_module.model.parameters(), *(p for g in inner.param_groups for p in g["params"])]
    live += [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.numel() > 1]
    with torch.no_grad():
        for tensor in live:
            tensor.add_(1.0)
    assert saver.in_flight and not is_checkpoint(tmp_path / "background.ckpt")  # not published before written
    saver.wait()
    assert stall < 3.0 and is_checkpoint(tmp_path / "background.ckpt")
    sync, background = (load_file(tmp_path / n / "rank-00000.safetensors") for n in ("sync.ckpt", "background.ckpt"))
    assert sorted(sync) == sorted(background) and any(k.startswith("optim/") for k in sync)
    assert all(torch.equal(sync[k], background[k]) for k in sync)
