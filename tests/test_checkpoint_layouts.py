"""Checkpoints that travel and survive, through `mtnlg fit` as a user runs it: 3 steps in layout A, 3 more in
layout B from A's checkpoint, the losses of 6 uninterrupted single-process steps; crashes and preemption."""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RENDEZVOUS_VARIABLES, ROOT, run_cli

from testing.run_watch import RunWatch

pytestmark = pytest.mark.distributed

LOSS_RTOL = 1e-5
FOUR_LAYERS = ["--model.model_overrides", "{num_layers: 4}"]  # interleaved pp2 needs 4 stages of blocks


def losses(save_dir: Path) -> dict[int, float]:
    """train_loss by step from the CSVLogger files under `save_dir` (every version: a restart writes a new one)."""
    out = {}
    for path in sorted(save_dir.rglob("metrics.csv")):
        for row in csv.DictReader(path.open()):
            if row.get("train_loss"):
                out[int(row["step"])] = float(row["train_loss"])
    return out


def fit_args(save_dir: Path, steps: int, strategy=None, devices=1, ckpt_dir=None, every=3, ckpt_path=None, extra=()):
    args = ["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", str(steps)]
    args += ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(save_dir)]
    if strategy:
        args += ["--trainer.strategy", f"configs/strategy/{strategy}.yaml", "--trainer.devices", str(devices)]
    if ckpt_dir is not None:
        args += ["--trainer.enable_checkpointing", "true", "--trainer.callbacks+=callbacks/checkpoint.yaml"]
        args += ["--trainer.callbacks.dirpath", str(ckpt_dir), "--trainer.callbacks.every_n_train_steps", str(every)]
    if ckpt_path is not None:
        args += ["--ckpt_path", str(ckpt_path)]
    return [*args, *extra]


def fit(*args, **kwargs) -> subprocess.CompletedProcess:
    result = run_cli(*fit_args(*args, **kwargs))
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted single-process runs: the tiny model for 12 steps, and its 4-block variant for 6."""
    out = tmp_path_factory.mktemp("reference")
    fit(out / "tiny", 12)
    fit(out / "four", 6, extra=FOUR_LAYERS)
    return {"tiny": losses(out / "tiny"), "four": losses(out / "four")}


def assert_continues(reference: dict[int, float], *runs: dict[int, float], first=0, last=6):
    combined = {step: loss for run in runs for step, loss in run.items()}
    assert sorted(combined) == list(range(first, last)), combined
    for step, loss in combined.items():
        assert loss == pytest.approx(reference[step], rel=LOSS_RTOL), (step, combined, reference)


# (name, layout A (strategy file, devices), layout B, extra args for both)
CROSS_LAYOUTS = [
    ("tp2xdp2_zero1-to-single", ("tp2_zero1", 4), (None, 1), ()),
    ("single-to-tp2xpp2xdp2_zero1", (None, 1), ("tp2_pp2_dp2", 8), ()),
    (
        "pp2xdp2_zero2-to-dp2_zero3",
        ("pp2", 4, ["--trainer.strategy.zero_stage", "2"]),
        ("zero3", 2),
        (),
    ),
    (
        "tp4-to-tp2xpp2_interleaved",
        ("tp4", 4),
        ("pp2_interleaved", 4, ["--trainer.strategy.tensor_parallel", "2"]),
        FOUR_LAYERS,
    ),
    ("dp2_zero0-to-tp2_zero1", ("dp_zero0", 2), ("tp2_zero1", 2), ()),
]


@pytest.mark.parametrize("name,layout_a,layout_b,extra", CROSS_LAYOUTS, ids=[c[0] for c in CROSS_LAYOUTS])
def test_resume_in_another_layout_continues_the_single_process_losses(
    tmp_path, reference, name, layout_a, layout_b, extra
):
    def run(save_dir, steps, layout, **kwargs):
        strategy, devices, *more = layout
        more = [*extra, *(more[0] if more else [])]
        fit(save_dir, steps, strategy=strategy, devices=devices, extra=more, **kwargs)

    run(tmp_path / "a", 3, layout_a, ckpt_dir=tmp_path / "ckpt")
    run(tmp_path / "b", 6, layout_b, ckpt_path=tmp_path / "ckpt" / "step=3.ckpt")
    expected = reference["four" if extra else "tiny"]
    assert_continues(expected, losses(tmp_path / "a"), losses(tmp_path / "b"))


# ------------------------------------------------------------------------------------------------ crashes
STARTED_JOBS: list[subprocess.Popen] = []
# pytest-timeout of a drill: above its waits' ceiling (testing/run_watch.py, 1500 s), so that a job that stalls fails
# in its wait, saying what it was doing
WATCHED = 2400


@pytest.fixture(autouse=True)
def no_job_outlives_its_test():
    """A drill that fails midway leaves no ranks behind to slow or block the tests after it."""
    yield
    while STARTED_JOBS:
        job = STARTED_JOBS.pop()
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=30)


def job_log(args) -> Path:
    """Where `start` writes a job's output: beside its logger's save_dir."""
    return Path(args[args.index("--trainer.logger.save_dir") + 1] + ".log")


def start(args, save_pause_s: float) -> subprocess.Popen:
    """A job in its own process group (as a scheduler sees it), output to files; each checkpoint file it writes
    stays unpublished `save_pause_s` seconds longer (testing/slow_checkpoint_writes.py)."""
    inherited = {key: value for key, value in os.environ.items() if key not in RENDEZVOUS_VARIABLES}
    full_env = {**inherited, "WANDB_MODE": "offline"}
    log = job_log(args).open("w")  # noqa: SIM115
    job = subprocess.Popen(
        [sys.executable, str(ROOT / "testing" / "slow_checkpoint_writes.py"), str(save_pause_s), *args],
        cwd=ROOT,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    STARTED_JOBS.append(job)
    return job


WRITTEN = ("--trainer.logger.save_dir", "--trainer.callbacks.dirpath")


def watch(job: subprocess.Popen) -> RunWatch:
    """The job, its log and what it writes (its logger's folder, its checkpoints), watched (testing/run_watch.py)."""
    written = [job.args[job.args.index(flag) + 1] for flag in WRITTEN if flag in job.args]
    return RunWatch({"job": (job, job_log(job.args))}, progress=[Path(p) for p in written])


def wait_for(condition, job: subprocess.Popen, what: str) -> RunWatch:
    """Until `condition()` holds, while the job makes progress; a job that ended first fails the test at once, and
    every failure says what the job was doing (its processes, the end of its log)."""
    job_watch = watch(job)
    job_watch.until(condition, what)
    return job_watch


def child_ranks(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.timeout(WATCHED)
def test_kill_9_of_the_job_during_a_save_resumes_from_the_previous_complete_checkpoint(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    args = fit_args(tmp_path / "a", 12, strategy="dp_zero0", devices=2, ckpt_dir=ckpt, every=2)
    job = start(args, save_pause_s=3)  # each save holds its files open for 3 s
    wait_for(lambda: (ckpt / ".step=4.ckpt.incomplete").exists(), job, "the save of step 4 to start")
    time.sleep(0.5)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    assert (ckpt / "step=2.ckpt" / "manifest.json").exists()
    assert not (ckpt / "step=4.ckpt").exists()  # the interrupted save is not taken for a checkpoint
    out = fit(tmp_path / "b", 12, strategy="dp_zero0", devices=2, ckpt_dir=ckpt, every=2, ckpt_path="last")
    assert "resuming from" in out.stdout + out.stderr and "step=2.ckpt" in out.stdout + out.stderr
    assert_continues(reference["tiny"], losses(tmp_path / "b"), first=2, last=12)


@pytest.mark.timeout(WATCHED)
def test_kill_9_of_one_rank_ends_the_job_within_60_s_and_it_resumes(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    args = fit_args(tmp_path / "a", 12, strategy="dp_zero0", devices=2, ckpt_dir=ckpt, every=2)
    job = start(args, save_pause_s=1)
    wait_for(lambda: (ckpt / "step=4.ckpt" / "manifest.json").exists(), job, "the checkpoint of step 4")
    (rank1,) = child_ranks(job.pid)
    os.kill(rank1, signal.SIGKILL)
    killed = time.monotonic()
    job.wait(timeout=60)
    assert job.returncode != 0 and time.monotonic() - killed < 60
    out = fit(tmp_path / "b", 12, strategy="dp_zero0", devices=2, ckpt_dir=ckpt, every=2, ckpt_path="last")
    resumed = losses(tmp_path / "b")
    assert min(resumed) >= 4, out.stdout[-2000:]
    assert_continues(reference["tiny"], resumed, first=min(resumed), last=12)


@pytest.mark.timeout(WATCHED)
@pytest.mark.parametrize("target", ["launcher", "one_rank"])
def test_sigterm_saves_on_every_rank_at_the_same_step_and_the_restart_matches(tmp_path, reference, target):
    ckpt = tmp_path / "ckpt"
    args = fit_args(tmp_path / "a", 12, strategy="dp_zero0", devices=2, ckpt_dir=ckpt, every=2)
    job = start(args, save_pause_s=1)
    job_watch = wait_for(lambda: (ckpt / "step=2.ckpt" / "manifest.json").exists(), job, "the checkpoint of step 2")
    pid = job.pid if target == "launcher" else child_ranks(job.pid)[0]
    os.kill(pid, signal.SIGTERM)
    assert job_watch.finish("job") == 75, (tmp_path / "a.log").read_text()[-3000:]  # preempted: resume me
    log = (tmp_path / "a.log").read_text()
    (line,) = [x for x in log.splitlines() if x.startswith("preemption (")]
    stopped = int(line.rsplit("at step ", 1)[1].split(";")[0])
    assert 2 <= stopped < 12 and (ckpt / f"step={stopped}.ckpt" / "manifest.json").exists()
    first = losses(tmp_path / "a")
    assert max(first) == stopped - 1  # no step after the agreed boundary
    fit(tmp_path / "b", 12, strategy="dp_zero0", devices=2, ckpt_dir=ckpt, every=2, ckpt_path="last")
    assert_continues(reference["tiny"], first, losses(tmp_path / "b"), last=12)
