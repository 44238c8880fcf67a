"""The 3D strategy through the real `mtnlg` CLI: `--trainer.strategy configs/strategy/X.yaml`, as a user runs it."""

import csv
import json

import pytest
from conftest import run_cli
from tiny_runs import OUTPUT, TINY_STEPS, tiny_run


def train_rows(save_dir):
    (path,) = list(save_dir.rglob("metrics.csv"))
    return [r for r in csv.DictReader(path.open()) if r.get("train_loss")]


def fit_single_and_parallel(
    tmp_path, strategy_file: str, devices: int, steps: int, *parallel_args: str, both: tuple[str, ...] = ()
):
    """The same tiny config (plus `both` arguments) through `mtnlg fit` on one process and on `devices` ranks with
    `strategy_file` (and `parallel_args`); asserts they train alike; returns (reference train rows, parallel train
    rows, parallel output)."""
    common = ["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", str(steps)]
    common += ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", *both]
    single = run_cli(*common, "--trainer.logger.save_dir", str(tmp_path / "single"))
    assert single.returncode == 0, single.stderr[-3000:]
    parallel = run_cli(
        *common,
        "--trainer.logger.save_dir",
        str(tmp_path / "parallel"),
        "--trainer.strategy",
        strategy_file,
        "--trainer.devices",
        str(devices),
        *parallel_args,
    )
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    reference, rows = train_rows(tmp_path / "single"), train_rows(tmp_path / "parallel")
    assert_trains_alike(reference, rows, steps)
    return reference, rows, parallel.stdout + parallel.stderr


def assert_trains_alike(reference: list[dict], rows: list[dict], steps: int) -> None:
    assert [int(r["step"]) for r in rows] == list(range(steps))  # one train_loss row per step, not one per rank
    for ref, row in zip(reference, rows, strict=True):
        assert float(row["train_loss"]) == pytest.approx(float(ref["train_loss"]), rel=1e-5)
        assert float(row["grad_norm"]) == pytest.approx(float(ref["grad_norm"]), rel=1e-4)


@pytest.mark.distributed
def test_tp2_zero1_on_4_ranks_logs_train_loss_once_per_step_matching_one_process(tmp_path):
    reference, rows, output = fit_single_and_parallel(tmp_path, "configs/strategy/tp2_zero1.yaml", 4, 5)
    # Rank 0 printed the layout table: TP pairs of consecutive ranks, ZeRO-1 across the DP pairs.
    assert "layout: world 4 = pp 1 x dp 2 x tp 2 on 1 node(s) of 4 rank(s)" in output
    for ref, row in zip(reference, rows, strict=True):
        assert float(row["lr"]) == pytest.approx(float(ref["lr"]), rel=1e-7)
    assert all(float(r["grad_norm"]) > 1.0 for r in reference)  # tiny.yaml's grad_clip 1.0 triggers


def start_up_errors(strategy: str, devices: int, *more_args: str) -> list[str]:
    """`mtnlg fit` of the tiny config under `strategy` on `devices` ranks, which must stop at start-up with exit
    status 2 and no traceback: its `mtnlg: error:` lines."""
    args = ["--config", "configs/tiny.yaml", "--trainer.strategy", strategy, "--trainer.devices", str(devices)]
    out = run_cli("fit", *args, *more_args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    return [line for line in out.stderr.splitlines() if line.startswith("mtnlg: error:")]


@pytest.mark.slow
def test_layout_that_does_not_fit_the_devices_fails_before_launch_with_one_line():
    errors = start_up_errors("configs/strategy/tp4.yaml", 2)
    assert errors == ["mtnlg: error: world size 2 is not divisible by tensor_parallel 4 x pipeline_parallel 1 = 4"]


@pytest.mark.slow
def test_more_pipeline_stages_than_blocks_is_one_line():
    errors = set(start_up_errors("configs/strategy/pp2.yaml", 3, "--trainer.strategy.init_args.pipeline_parallel", "3"))
    assert errors == {"mtnlg: error: num_layers 2 is fewer than pipeline_parallel 3 stages"}


@pytest.mark.distributed
def test_tp2_pp2_dp2_on_8_ranks_trains_like_one_process_and_validates_through_the_pipeline(tmp_path_factory):
    single, parallel = tiny_run(tmp_path_factory, "single"), tiny_run(tmp_path_factory, "tp2xpp2xdp2")  # tiny_runs.py
    assert_trains_alike(train_rows(single), train_rows(parallel), TINY_STEPS)
    assert "layout: world 8 = pp 2 x dp 2 x tp 2 on 1 node(s) of 8 rank(s)" in (parallel / OUTPUT).read_text()

    def val(d):
        return [
            float(r["val_loss"])
            for r in csv.DictReader(next(d.rglob("metrics.csv")).open())  # noqa: E731
            if r.get("val_loss")
        ]

    assert val(parallel) == pytest.approx(val(single), rel=1e-5)  # forward-only pipeline
    assert len(val(parallel)) == 1


@pytest.mark.distributed
def test_sequence_parallel_tp2_x_pp2_under_the_pytorch_profiler_writes_a_trace_per_rank_and_logs_peak_memory(tmp_path):
    pipeline = ("--trainer.strategy.init_args.pipeline_parallel", "2")
    _, rows, output = fit_single_and_parallel(
        tmp_path, "configs/strategy/tp2_sp.yaml", 4, 5, *pipeline, "--trainer.profiler", "pytorch"
    )
    assert "layout: world 4 = pp 2 x dp 1 x tp 2 on 1 node(s) of 4 rank(s)" in output
    # Lightning names each trace by stage, local rank and action: fit-<rank>-[Strategy]...training_step...
    traces = list((tmp_path / "parallel").rglob("*training_step*.pt.trace.json"))
    assert sorted(int(path.name.split("-")[1]) for path in traces) == [0, 1, 2, 3], traces
    for path in traces:
        assert json.loads(path.read_text())["traceEvents"]  # a Chrome/Perfetto trace with events
    peaks = [float(row["peak_memory_mib"]) for row in rows]
    assert len(peaks) == 5 and all(50 < peak < 16_000 for peak in peaks), peaks  # MiB of a live process


@pytest.mark.distributed
def test_sequence_length_not_divisible_by_tensor_parallel_fails_at_start_up_with_one_line():
    errors = set(start_up_errors("configs/strategy/tp2_sp.yaml", 2, "--model.model_overrides", "{seq_len: 63}"))
    assert errors == {
        "mtnlg: error: sequence_parallel: seq_len 63 is not divisible by tensor_parallel 2; choose a seq_len "
        "that is a multiple of 2 or set sequence_parallel: false"
    }
