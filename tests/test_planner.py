"""tools/plan.py: the paper's arithmetic, memory accounting, layout validation; the GPU check's CPU smoke mode."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.planner import model_state_bytes, plan, search, tflops_from_time

MTNLG = get_config("mtnlg-530b")


@pytest.mark.parametrize("nodes,seconds,reported", [(280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113)])
def test_planner_reproduces_the_papers_tflops_from_its_iteration_times(nodes, seconds, reported):
    assert tflops_from_time(MTNLG, 1920, seconds, nodes * 8) == pytest.approx(reported, rel=0.02)


def test_the_papers_530b_layout_fits_in_80gb_with_3_layers_per_stage():
    p = plan(
        MTNLG,
        tp=8,
        pp=35,
        dp=16,
        gpus_per_node=8,
        gpu="a100-80g",
        global_batch=1920,
        micro_batch=1,
        recompute="full",
        zero_stage=1,
    )
    assert p.layers_per_stage == [3] * 35
    assert p.fits and p.total_gb < 80 and p.tp_within_node
    assert p.num_microbatches == 120
    assert p.bubble == pytest.approx(34 / (120 + 34))
    assert 1.9e9 < p.params_per_gpu < 2.2e9  # 530B / 280 model-parallel GPUs, plus the embedding shard


def test_530b_without_recompute_and_without_zero_does_not_fit():
    p = plan(
        MTNLG, tp=8, pp=35, dp=8, gpus_per_node=8, gpu="a100-80g", global_batch=1920, recompute="none", zero_stage=0
    )
    assert not p.fits


def test_model_states_are_20_bytes_per_parameter_and_zero_shards_them():
    assert model_state_bytes(1000, dp=1, zero_stage=0) == 20_000
    assert model_state_bytes(1000, dp=4, zero_stage=1) == 1000 * (2 + 6 + 12 / 4)
    assert model_state_bytes(1000, dp=4, zero_stage=2) == 1000 * (2 + (6 + 12) / 4)
    assert model_state_bytes(1000, dp=4, zero_stage=3) == 20_000 / 4


def test_tp_across_nodes_is_flagged_and_invalid_layouts_are_errors():
    assert not plan(MTNLG, 16, 35, 1, 8, "a100-80g", 1920).tp_within_node
    with pytest.raises(MTNLGError, match="num_heads 128 is not divisible by tensor_parallel 3"):
        plan(MTNLG, 3, 35, 1, 8, "a100-80g", 1920)
    with pytest.raises(MTNLGError, match="106 is more stages than the model's 105 layers"):
        plan(MTNLG, 8, 106, 1, 8, "a100-80g", 1920)


def test_search_returns_only_fitting_layouts_fastest_first():
    plans = search(get_config("gpt3-1.3b"), num_gpus=16, gpus_per_node=8, gpu="a100-80g", global_batch=512)
    assert plans and all(p.fits and p.tp_within_node and p.gpus == 16 for p in plans)
    times = [p.iteration_seconds for p in plans]
    assert times == sorted(times)


def test_plan_cli_prints_every_figure_and_validates():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/plan.py"),
            "--model",
            "mtnlg-530b",
            "--tp",
            "8",
            "--pp",
            "35",
            "--dp",
            "16",
            "--gpus-per-node",
            "8",
            "--gpu",
            "a100-80g",
            "--global-batch",
            "1920",
            "--micro-batch",
            "1",
            "--recompute",
            "full",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    for text in (
        "layers per stage     3",
        "params per GPU",
        "model states",
        "activations",
        "fits",
        "TP inside a node     yes",
        "pipeline bubble",
        "FLOPs per iteration",
        "TFLOP/s per GPU",
    ):
        assert text in out.stdout
    out = subprocess.run([sys.executable, str(ROOT / "tools/plan.py"), "--tp", "3"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("plan: error: num_heads 128")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/plan.py"),
            "--model",
            "gpt3-1.3b",
            "--gpus",
            "16",
            "--global-batch",
            "512",
            "--search",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and json.loads(out.stdout)[0]["fits"]


def test_gpu_check_cpu_smoke_mode_runs_the_training_machinery():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--cpu-smoke"],
        capture_output=True,
        text=True,
        timeout=600,
        env={"WANDB_MODE": "offline", **__import__("os").environ},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch 2" in out.stdout and "median tokens/s" in out.stdout
