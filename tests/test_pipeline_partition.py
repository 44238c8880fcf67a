"""Pipeline stage partitioning, stage pruning and the MT-NLG 530B dry run (no processes, no memory)."""

import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run_cli

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.model import build_model
from mtnlg_lightning.parallel.pipeline import build_stage, layers_per_stage, schedule_class, stages_held_by_rank


def test_mtnlg_105_layers_on_35_stages_is_3_per_stage():
    assert layers_per_stage(105, 35) == [3] * 35


def test_uneven_blocks_go_to_middle_stages_and_explicit_first_last_counts_are_honoured():
    assert layers_per_stage(5, 2) == [3, 2]
    assert layers_per_stage(10, 4) == [2, 3, 3, 2]
    assert layers_per_stage(10, 4, first_stage_layers=1, last_stage_layers=1) == [1, 4, 4, 1]
    assert layers_per_stage(6, 3, last_stage_layers=1) == [2, 3, 1]


def test_impossible_partitions_are_clear_errors():
    with pytest.raises(MTNLGError, match="3 pipeline stages is more than the model's 2 layers"):
        layers_per_stage(2, 3)
    with pytest.raises(MTNLGError, match="leave"):
        layers_per_stage(4, 3, first_stage_layers=2, last_stage_layers=2)


def test_stage_placement_is_looped_or_v_shaped():
    assert stages_held_by_rank("interleaved_1f1b", 2, 2) == [[0, 2], [1, 3]]
    assert stages_held_by_rank("zbv_zero_bubble", 2, 2) == [[0, 3], [1, 2]]
    with pytest.raises(MTNLGError, match="unknown pipeline schedule 'dualpipe'"):
        schedule_class("dualpipe")


def test_stages_keep_their_blocks_under_global_names_and_the_last_stage_holds_a_head_copy():
    torch.manual_seed(0)
    model = build_model(get_config("tiny", num_layers=5))
    embedding = model.embed.wte.weight.detach().clone()
    first = build_stage(build_model(get_config("tiny", num_layers=5)), 0, [3, 2])
    torch.manual_seed(0)
    last = build_stage(build_model(get_config("tiny", num_layers=5)), 1, [3, 2])
    assert list(first.blocks) == ["0", "1", "2"] and first.norm is None and first.lm_head is None
    assert list(last.blocks) == ["3", "4"] and last.embed is None
    assert "lm_head.weight" not in dict(last.named_parameters())  # a per-step copy, not a second parameter
    assert torch.equal(last.lm_head.weight, embedding) and last.lm_head.weight.requires_grad


@pytest.mark.slow
def test_dry_run_of_the_papers_530b_config_builds_every_stage_on_meta():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools/dry_run.py"), "--config", str(ROOT / "configs/mtnlg_530b.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "world 4480 = 560 node(s) x 8: pp 35 x dp 16 x tp 8; TP groups inside a node: yes" in text
    assert "blocks per stage 3" in text and "529.6B parameters" in text
    assert "32 -> 1920 sequences" in text and "micro-batches per pipeline 2 -> 120" in text
    assert "-> fits" in text and "recompute: full" in text
    # Memory per GPU with and without sequence parallelism (SP shards the stored activations over TP).
    sp = re.search(r"without SP ([\d.]+) GB .* with SP ([\d.]+) GB", text)
    assert sp and float(sp[2]) < float(sp[1])
    # And how many GPUs evaluating the model takes (tests/test_inference_plan.py checks the figures).
    assert "to evaluate or generate with mtnlg-530b (bf16 weights, KV cache of 1 x 2048 tokens)" in text
    assert re.search(r"\n  a100-80g   tp8 x pp2 = 16 GPUs: .*\n(.*\n)*  h200       tp1 x pp9 = 9 GPUs", text)


@pytest.mark.slow
def test_dry_run_rejects_a_layout_that_does_not_fit_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  strategy:\n    init_args: {tensor_parallel: 16}\n")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/dry_run.py"),
            "--config",
            str(ROOT / "configs/mtnlg_530b.yaml"),
            "--config",
            str(bad),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "mtnlg-dry-run: error: tensor_parallel 16 is larger than a node (8 ranks per node): TP "
        "groups would cross nodes; lower tensor_parallel or set allow_tp_across_nodes: true"
    )


@pytest.mark.slow
def test_530b_config_parses_through_the_cli():
    out = run_cli("fit", "--print_config", "--config", "configs/mtnlg_530b.yaml")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pipeline_parallel: 35" in out.stdout and "rampup_batch_size:" in out.stdout
