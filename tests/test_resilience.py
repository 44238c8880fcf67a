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
from mtnlg_lightning.resilience.watchdog import resolve_limits

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
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])  # benchmarks.fault_probe
    full_env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": pythonpath, **(env or {})}
    handle = open(log, "w")  # noqa: SIM115
    return subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=handle, stderr=subprocess.STDOUT)


def wait_for(condition, timeout=240.0, what=""):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # exited, not yet reaped by the launcher


def logged_steps(save_dir: Path) -> set[int]:
    """The steps with a train_loss row so far (the file is being written: a partial last row is not one yet)."""
    try:
        return set(losses(save_dir))
    except (ValueError, KeyError):
        return set()


def last_step(path: Path, pid: int) -> int:
    steps = [int(s) for p, s in (line.split() for line in path.read_text().splitlines()) if int(p) == pid]
    return max(steps, default=-1)


@pytest.mark.distributed
def test_a_stopped_rank_is_caught_and_the_restart_resumes_from_the_newest_checkpoint(tmp_path):
    """2-rank ZeRO-1 under `--max-restarts 1`, one rank slowed (straggler line) then SIGSTOPped mid-run: its peer's
    watchdog dumps the stacks and exits 124 within the step limit + a few seconds; the group restarts, meets again,
    resumes by itself from the newest complete checkpoint of Lightning's own ModelCheckpoint, writes no second copy
    of a step, says why it restarted and redoes the steps after the checkpoint exactly as they were."""
    steps, step_limit, ckpt, probe = 10, 5.0, tmp_path / "ckpt", tmp_path / "probe"
    args = ["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", str(steps)]
    args += ["--trainer.strategy", "configs/strategy/zero1.yaml", "--trainer.devices", "2"]
    args += ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path)]
    args += ["--trainer.enable_checkpointing", "true", "--ckpt_path", "last"]
    args += ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", "--trainer.callbacks.dirpath"]
    args += [str(ckpt), "--trainer.callbacks.every_n_train_steps", "2", "--trainer.callbacks.save_top_k", "-1"]
    args += ["--trainer.callbacks+=benchmarks.fault_probe.Probe", "--trainer.callbacks.dir", str(probe)]
    args += ["--trainer.callbacks.slow_rank", "1", "--trainer.callbacks.slow_s", "0.3"]
    args += ["--model.straggler_every_n_steps", "2"]
    env = {"MTNLG_STEP_TIMEOUT": str(step_limit), "MTNLG_SAVE_TIMEOUT": "30"}
    job = launch(args, tmp_path / "log", max_restarts=1, env=env)
    try:
        wait_for(lambda: (probe / "rank1.steps").exists(), what="the first step")
        pids = {r: int((probe / f"rank{r}.pid").read_text()) for r in (0, 1)}
        wait_for(lambda: last_step(probe / "rank1.steps", pids[1]) >= 5, what="step 5")
        # and rank 0 has logged step 4, the first after the checkpoint of step 4: there is a step to redo (under
        # load rank 0 can lag, and a stop that lands before it logs step 4 leaves nothing after the checkpoint)
        wait_for(lambda: 4 in logged_steps(tmp_path / "lightning_logs" / "version_0"), what="rank 0 to log step 4")
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(lambda: not alive(pids[0]), timeout=step_limit + 60, what="the watchdog of rank 0")
        detected = time.monotonic() - stopped
        assert job.wait(timeout=300) == 0, (tmp_path / "log").read_text()[-4000:]
    finally:
        if job.poll() is None:
            job.kill()
    log = (tmp_path / "log").read_text()
    assert detected < step_limit + 5, (detected, log[-3000:])
    assert re.search(r"mtnlg watchdog: rank 0 on .*: no progress in step for \d+ s", log), log[-3000:]
    assert "mtnlg watchdog: waiting in torch.distributed." in log and "(most recent call first)" in log
    assert "connectFullMesh" not in log  # the restarted group met again at the first try
    (restart,) = re.findall(r"restart 1: resumed from step (\d+) \((.*)\)", log)
    assert "rank 0 hang (exit 124)" in restart[1]
    resumed = int(restart[0])
    saved = sorted(int(re.search(r"step=(\d+)", p.name)[1]) for p in ckpt.iterdir() if not p.name.startswith("."))
    assert resumed >= 4 and resumed in saved and resumed == max(s for s in saved if s <= resumed)
    assert not [p.name for p in ckpt.iterdir() if "-v" in p.name]  # no second copy of a step
    assert re.search(rf"straggler: rank 1 on {re.escape(socket.gethostname())} took", log), log[-3000:]
    attempts = [losses(path.parent) for path in sorted((tmp_path / "lightning_logs").glob("version_*/metrics.csv"))]
    assert len(attempts) == 2 and sorted(attempts[1]) == list(range(resumed, steps))
    overlap = sorted(set(attempts[0]) & set(attempts[1]))
    assert overlap and overlap[0] == resumed  # the steps after the checkpoint were redone, none before it
    assert all(attempts[1][s] == attempts[0][s] for s in overlap)  # and redone exactly as before the fault
    assert max(attempts[0]) + 1 - resumed <= 2  # no more recomputation than the save interval


@pytest.mark.distributed
def test_a_configuration_error_exits_once_with_its_code_and_is_not_restarted_even_when_rank_0_is_last(tmp_path):
    """Rank 1 fails first; torchrun alone would SIGTERM rank 0, the rank that prints the error, before it gets there."""
    args = ["fit", "--config", "configs/tiny.yaml", "--trainer.strategy", "configs/strategy/zero1.yaml"]
    args += ["--trainer.devices", "2", "--trainer.strategy.zero_stage", "7"]
    late_rank_zero = (str(Path(__file__).parent / "late_rank_zero.py"), "5")
    job = launch(args, tmp_path / "log", max_restarts=3, entry=late_rank_zero)
    assert job.wait(timeout=300) == ExitCode.CONFIG_ERROR
    log = (tmp_path / "log").read_text()
    assert log.count("mtnlg: error: zero_stage 7 is not one of") == 1, log[-3000:]  # one attempt, one line
    assert "not restarting" in log and "will restart worker group" not in log, log[-3000:]


# ------------------------------------------------------------------------------------------------ background saves
@pytest.mark.slow
def test_a_background_save_writes_the_state_of_its_step_while_training_changes_it(tmp_path, monkeypatch):
    """ZeRO-1, one rank: the background save returns before its (held) write, every weight, master weight and
    Adam moment is then changed in place, as the next steps would; the published checkpoint still holds the saved
    step's state, bit for bit as a synchronous save of it."""
    from parallel_harness import tiny_run
    from safetensors.torch import load_file
    from slow_checkpoint_writes import slowed

    from mtnlg_lightning.checkpoint import format as checkpoint_format
    from mtnlg_lightning.checkpoint.format import is_checkpoint
    from mtnlg_lightning.parallel.zero import base_optimizer
    from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy

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
