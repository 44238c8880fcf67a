"""The planner's cost model against published runs (mtnlg_lightning/planning/published_runs.yaml), one set
of constants per GPU: every run's throughput predicted within +-15%, and searching each published configuration's
model, GPU count and batch ranks the published layout in the top 3 or within 5% of the best predicted time."""

import subprocess
import sys

import pytest
from conftest import ROOT

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.planning.cost_model import IMPLEMENTATIONS
from mtnlg_lightning.planning.planner import plan
from mtnlg_lightning.planning.planner_validation import layout_rank, load_runs, predict, throughput_error

SOURCES, RUNS = load_runs()
BY_NAME = {run.name: run for run in RUNS}
# Searches that rank a smaller-TP decomposition more than 5% ahead of the published TP 8 layout (both at DP 32,
# 12% by the model's arithmetic): TP 2-4 x PP 4 avoids most of TP 8's 16% (18.4B) / 13% (39.1B) of unoverlapped
# all-reduces (6 per layer and micro-batch with full recompute, Megatron 2021 had no TP overlap) for a 3-5% bubble
# and 1-2% of pipeline sends. The misses stay at 1.07-1.10x even with NVLink at 100% of its data-sheet bandwidth,
# so they are not a constant away; the authors picked TP 8 by their rule "TP up to the node size, then PP"
# (Narayanan et al. 2021, Takeaway #1), not by a search. Kept visible here rather than tuned away.
KNOWN_RANK_MISSES = {"narayanan2021-18.4b", "narayanan2021-39.1b"}


def test_the_data_holds_every_published_point_with_its_source():
    counts = {source: sum(run.source == source for run in RUNS) for source in SOURCES}
    assert counts == {"narayanan2021": 10, "mtnlg2022": 3, "korthikanti2022": 9, "megatron_core_h100": 9}
    assert all("arXiv" in text or "README" in text for text in SOURCES.values())
    mtnlg = [BY_NAME[f"mtnlg2022-{n}-nodes"] for n in (280, 350, 420)]
    assert [run.gpus for run in mtnlg] == [2240, 2800, 3360] and [run.value for run in mtnlg] == [60.1, 50.2, 44.4]
    assert BY_NAME["narayanan2021-1008b"].gpus == 3072 and BY_NAME["narayanan2021-1008b"].value == 163


@pytest.mark.parametrize("name", list(BY_NAME))
def test_predicted_throughput_is_within_15_percent_of_the_published(name):
    run = BY_NAME[name]
    assert abs(throughput_error(run, predict(run))) <= 0.15


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(run.name, marks=pytest.mark.xfail(strict=True, reason="see KNOWN_RANK_MISSES"))
        if run.name in KNOWN_RANK_MISSES
        else run.name
        for run in RUNS
        if run.source in ("narayanan2021", "mtnlg2022")
    ],
)
def test_search_ranks_the_published_layout_in_the_top_3_or_within_5_percent_of_the_best(name):
    rank, vs_best = layout_rank(BY_NAME[name])
    assert rank is not None and (rank <= 3 or vs_best <= 1.05)


@pytest.mark.parametrize("batch", [32, 128, 512])
def test_tp_8_leads_the_papers_tp_versus_pp_experiment(batch):
    """Narayanan et al. 2021, Figure 13: 162.2B parameters (32 layers of h 20480) on 64 GPUs at DP 1, t x p = 64;
    they measured TP 8 x PP 8 best. The model: TP 8 x PP 8 at least level with TP 4 x PP 16, ahead of TP 2 x PP 32
    (each with its best micro-batch and interleaving that Megatron 2021 could run)."""
    config = ModelConfig(num_layers=32, hidden_size=20480, num_heads=128, seq_len=2048, vocab_size=51200, name="162b")
    impl = IMPLEMENTATIONS["megatron-2021"]

    def best(tp, pp):
        return min(
            plan(
                config, tp, pp, 1, 8, "a100-80g", batch, mb, "full", 0, virtual_stages=v, implementation=impl
            ).iteration_seconds
            for mb in (1, 2, 4)
            for v in (1, 2, 4)
            if (v == 1 or (batch // mb) % pp == 0) and impl.runs_pipeline(32, pp, v)
        )

    tp8, tp4, tp2 = best(8, 8), best(4, 16), best(2, 32)
    assert tp8 <= 1.01 * tp4 and tp8 < tp2


def test_a_published_layout_its_software_cannot_run_is_reported(tmp_path):
    """Megatron-LM splits layers evenly: 36 layers on 8 stages is no layout of its, whatever the micro-batch."""
    runs = tmp_path / "runs.yaml"
    runs.write_text(
        "sources: {x: 'arXiv 0000.00000'}\nruns:\n  - {name: bad, source: x, gpu: a100-80g, implementation: "
        "megatron-2021,\n     model: {num_layers: 36, hidden_size: 4096, num_heads: 32, seq_len: 2048, vocab_size: "
        "51200},\n     layout: {tp: 8, pp: 8, dp: 1, micro_batch: null, virtual_stages: null, recompute: full, "
        "zero_stage: 0},\n     global_batch: 64, published: {iteration_seconds: 10}}\n"
    )
    _, (run,) = load_runs(runs)
    with pytest.raises(MTNLGError, match="tp 8 pp 8 dp 1 divides the batch or runs on megatron-2021 \\(36 layers\\)"):
        predict(run)


def test_validate_planner_prints_the_readme_table():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools/validate_planner.py"), "--no-rank"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == len(RUNS) + 1  # the header and one row per run
    assert f"{len(RUNS)} of {len(RUNS)} runs predicted within +-15%" in out.stdout
