"""How many GPUs to evaluate a model (tools/plan.py --inference, the dry run's last lines): weights in bf16, the KV
cache of a batch, the working set; the smallest TP x PP per GPU kind is the smallest that fits."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import count_parameters
from mtnlg_lightning.gpus import get_gpu
from mtnlg_lightning.planning.inference_plan import inference_plan, smallest_layouts
from mtnlg_lightning.planning.planner import MEMORY_BUDGET

MTNLG = get_config("mtnlg-530b")


def run_plan(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools/plan.py"), *args], capture_output=True, text=True)


def test_one_gpu_holds_the_whole_model_in_two_bytes_per_parameter():
    p = inference_plan(MTNLG, 1, 1, "h200")
    assert p.weights_gb * 1e9 == pytest.approx(2 * count_parameters(MTNLG), rel=1e-3)  # 1.06 TB
    assert 1.05e3 < p.weights_gb < 1.07e3 and not p.fits


def test_the_kv_cache_is_keys_and_values_of_every_layer_split_over_tp_and_pp():
    gpt3 = get_config("gpt3-175b")  # 96 layers, hidden 12288: 2 x 96 x 2048 x 12288 x 2 bytes = 9.66 GB a sequence
    whole = inference_plan(gpt3, 1, 1, "h200", batch=1, length=2048).kv_cache_gb
    assert whole == pytest.approx(2 * 96 * 2048 * 12288 * 2 / 1e9)
    assert inference_plan(gpt3, 8, 4, "h200", batch=4, length=2048).kv_cache_gb == pytest.approx(whole * 4 / 8 / 4)
    fp32 = inference_plan(gpt3, 1, 1, "h200", batch=1, length=2048, dtype="fp32")
    assert fp32.kv_cache_gb == pytest.approx(2 * whole)


@pytest.mark.parametrize("gpu,gpus,layout", [("a100-80g", 16, (8, 2)), ("h200", 9, (1, 9))])
def test_the_smallest_layout_for_530b_fits_and_nothing_smaller_does(gpu, gpus, layout):
    plans = smallest_layouts(MTNLG, gpu, batch=1, length=2048)
    best = plans[0]
    assert (best.gpus, (best.tp, best.pp)) == (gpus, layout) and best.fits
    assert best.total_gb <= MEMORY_BUDGET * get_gpu(gpu).memory_gb
    # The bf16 weights alone need at least this many GPUs' budgets.
    assert best.gpus >= 2 * count_parameters(MTNLG) / (MEMORY_BUDGET * get_gpu(gpu).memory_gb * 1e9)
    for tp in (1, 2, 4, 8):
        for pp in range(1, (gpus - 1) // tp + 1):  # every layout of fewer GPUs
            assert not inference_plan(MTNLG, tp, pp, gpu, batch=1, length=2048).fits, (tp, pp)
    for p in plans:  # each TP degree's entry is its fewest stages
        assert p.fits and (p.pp == 1 or not inference_plan(MTNLG, p.tp, p.pp - 1, gpu, 1, 2048).fits)


def test_a_bigger_batch_or_longer_sequences_need_at_least_as_many_gpus():
    gpt3 = get_config("gpt3-175b")
    counts = [smallest_layouts(gpt3, "a100-80g", batch, 2048)[0].gpus for batch in (1, 8, 32)]
    assert counts == sorted(counts) and counts[-1] > counts[0]


def test_bad_inference_layouts_are_one_line():
    with pytest.raises(MTNLGError, match="num_heads 128 is not divisible by tensor_parallel 3"):
        inference_plan(MTNLG, 3, 1, "h200")
    with pytest.raises(MTNLGError, match="length 4096 is above the model's 2048 positions"):
        inference_plan(MTNLG, 8, 2, "h200", length=4096)


def test_plan_cli_answers_how_many_gpus_to_evaluate():
    out = run_plan("--inference", "--model", "mtnlg-530b", "--gpu", "a100-80g,h200", "--batch", "1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("to evaluate or generate with mtnlg-530b (bf16 weights, KV cache of 1 x 2048 tokens)")
    assert lines[1].startswith("  a100-80g   tp8 x pp2 = 16 GPUs: ") and lines[2].startswith("  h200       tp1 x pp9")
    found = json.loads(run_plan("--inference", "--model", "gpt3-1.3b", "--gpu", "h200", "--json").stdout)
    assert found["h200"][0]["gpus"] == 1 and found["h200"][0]["fits"]
    bad = run_plan("--inference", "--gpu", "h200,b9000")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("mtnlg-plan: error: unknown gpu 'b9000'") and len(bad.stderr.splitlines()) == 1
