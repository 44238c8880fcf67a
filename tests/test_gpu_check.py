"""scripts/gpu_check.sh cannot rot before a GPU is lent: its dry run runs every stage (equivalence with compiled
blocks and bf16, 2 gloo ranks; bf16 training eager/compiled x activation checkpointing; generation vs transformers;
evaluation vs lm-eval; Gated DeltaNet's kernels against its torch path, plain-torch stand-ins for the kernels) at tiny
sizes on CPU and writes the one JSON of results."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # one 2-rank launch inside


@pytest.mark.timeout(1800)  # ~2-3 min on an idle 2-core machine; 15+ min measured with a load average of 30-50
def test_gpu_check_dry_run_runs_every_stage_and_writes_one_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["dry_run"] and result["environment"]["torch"]
    equivalence = result["equivalence"]
    assert equivalence["compiled_loss_rel"] <= 1e-5 and equivalence["compiled_param_diff"] <= 2e-5
    assert equivalence["distributed"]["tp2"]["ok"]
    training = result["training"]
    assert {"eager_ac_none", "eager_ac_full", "compiled_ac_none", "compiled_ac_full"} <= training.keys()
    assert all(
        training[k]["tokens_per_s"] > 0 and training[k]["finite"] for k in training if k.endswith(("none", "full"))
    )
    assert result["generation"]["same_greedy_tokens"] is True
    assert result["evaluation"]["ours_acc"] == pytest.approx(result["evaluation"]["lm_eval_acc"])
    deltanet = result["gated_deltanet"]
    assert deltanet["kernels"].startswith("plain-torch stand-ins") and deltanet["float32_packed"]["ok"]
    assert deltanet["bfloat16_packed"]["ok"] and deltanet["timing_bf16"]["packed"]["kernels_ms"] > 0
    assert not list(tmp_path.glob("*.tmp"))  # written atomically


def test_gpu_check_without_a_gpu_and_without_dry_run_is_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the full check would run")
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--output", str(tmp_path / "x.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("gpu_check: error: no CUDA GPU")
    assert not (tmp_path / "x.json").exists()
