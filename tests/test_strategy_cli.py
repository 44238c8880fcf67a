"""The 3D strategy through the real `mtnlg` CLI: `--trainer.strategy configs/strategy/X.yaml`, as a user runs it."""
import csv

import pytest

from conftest import run_cli


def train_rows(save_dir):
    (path,) = list(save_dir.rglob("metrics.csv"))
    return [r for r in csv.DictReader(path.open()) if r.get("train_loss")]


@pytest.mark.distributed
def test_tp2_zero1_on_4_ranks_logs_train_loss_once_per_step_matching_one_process(tmp_path):
    common = ["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "5",
              "--trainer.logger", "lightning.pytorch.loggers.CSVLogger"]
    single = run_cli(*common, "--trainer.logger.save_dir", str(tmp_path / "single"))
    assert single.returncode == 0, single.stderr[-3000:]
    parallel = run_cli(*common, "--trainer.logger.save_dir", str(tmp_path / "tp2_zero1"),
                       "--trainer.strategy", "configs/strategy/tp2_zero1.yaml", "--trainer.devices", "4")
    assert parallel.returncode == 0, parallel.stderr[-3000:]

    # Rank 0 printed the layout table: TP pairs of consecutive ranks, ZeRO-1 across the DP pairs.
    assert "layout: world 4 = pp 1 x dp 2 x tp 2 on 1 node(s) of 4 rank(s)" in parallel.stdout + parallel.stderr

    reference, rows = train_rows(tmp_path / "single"), train_rows(tmp_path / "tp2_zero1")
    assert [int(r["step"]) for r in rows] == list(range(5))  # one train_loss row per step, not one per rank
    for ref, row in zip(reference, rows):
        assert float(row["train_loss"]) == pytest.approx(float(ref["train_loss"]), rel=1e-5)
        assert float(row["lr"]) == pytest.approx(float(ref["lr"]), rel=1e-7)
        assert float(row["grad_norm"]) == pytest.approx(float(ref["grad_norm"]), rel=1e-4)
    assert all(float(r["grad_norm"]) > 1.0 for r in reference)  # tiny.yaml's grad_clip 1.0 triggers


def test_layout_that_does_not_fit_the_devices_fails_before_launch_with_one_line():
    out = run_cli("fit", "--config", "configs/tiny.yaml", "--trainer.strategy", "configs/strategy/tp4.yaml",
                  "--trainer.devices", "2")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("mtnlg: error:")]
    assert errors == ["mtnlg: error: world size 2 is not divisible by tensor_parallel 4 x pipeline_parallel 1 = 4"]


def test_more_pipeline_stages_than_blocks_is_one_line():
    out = run_cli("fit", "--config", "configs/tiny.yaml", "--trainer.strategy", "configs/strategy/pp2.yaml",
                  "--trainer.strategy.init_args.pipeline_parallel", "3", "--trainer.devices", "3")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    errors = {line for line in out.stderr.splitlines() if line.startswith("mtnlg: error:")}
    assert errors == {"mtnlg: error: num_layers 2 is fewer than pipeline_parallel 3 stages"}


@pytest.mark.distributed
def test_tp2_pp2_dp2_on_8_ranks_trains_like_one_process_and_validates_through_the_pipeline(tmp_path):
    common = ["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", "4",
              "--trainer.logger", "lightning.pytorch.loggers.CSVLogger"]
    single = run_cli(*common, "--trainer.logger.save_dir", str(tmp_path / "single"))
    assert single.returncode == 0, single.stderr[-3000:]
    parallel = run_cli(*common, "--trainer.logger.save_dir", str(tmp_path / "3d"),
                       "--trainer.strategy", "configs/strategy/tp2_pp2_dp2.yaml", "--trainer.devices", "8")
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    assert "layout: world 8 = pp 2 x dp 2 x tp 2 on 1 node(s) of 8 rank(s)" in parallel.stdout + parallel.stderr

    reference, rows = train_rows(tmp_path / "single"), train_rows(tmp_path / "3d")
    assert [int(r["step"]) for r in rows] == list(range(4))  # one train_loss row per step
    for ref, row in zip(reference, rows):
        assert float(row["train_loss"]) == pytest.approx(float(ref["train_loss"]), rel=1e-5)
        assert float(row["grad_norm"]) == pytest.approx(float(ref["grad_norm"]), rel=1e-4)
    val = lambda d: [float(r["val_loss"]) for r in csv.DictReader(next(d.rglob("metrics.csv")).open())  # noqa: E731
                     if r.get("val_loss")]
    assert val(tmp_path / "3d") == pytest.approx(val(tmp_path / "single"), rel=1e-5)  # forward-only pipeline
    assert len(val(tmp_path / "3d")) == 1
