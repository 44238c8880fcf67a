"""A mixture of experts over pipeline stages: each stage passes the router statistics of its layers on with its
activations (`parallel/pipeline.carry_router_totals`), so the last stage's auxiliary loss couples every layer's
routing as one process does and its gradient reaches every stage's routers. Specified by training 5-6 steps from
a 4-block Qwen 3-MoE directory (blocks 0, 2, 3 MoE, block 1 dense; dropless, the auxiliary and z losses on): ep2 x
pp2 under 1F1B and interleaved 1F1B (two stages per rank), pp4 (its second stage holds the dense block only) on 4
ranks, ep2 x tp2 x pp2 on 8, each equal to one
process in its losses, gradient norms, parameters and router logs; the ep2 x tp2 x pp2 checkpoint resumes in one
process with the uninterrupted losses and exports to a directory transformers loads with our logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_moe_runs import run_settings
from hf_models import exported_logits_gap, random_moe_dir

from mtnlg_lightning.interop.export_cli import main as export_main
from mtnlg_lightning.interop.hf import source_config
from mtnlg_lightning.parallel.pipeline import layers_per_stage
from testing.parallel_harness import assert_resumes_like, assert_trains_like, launch_runs, tiny_run, trained

SCRIPT = Path(__file__).resolve().parent / "dist_moe_runs.py"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return random_moe_dir(tmp_path_factory.mktemp("qwen3_moe_4"), "qwen3_moe", num_hidden_layers=4)


@pytest.fixture(scope="module")
def runs(moe_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_moe_runs")
    four = launch_runs(SCRIPT, out, ["ep2_pp2", "pp4", "ep2_pp2_v2"], ranks=4, args=(moe_dir,))
    eight = launch_runs(SCRIPT, out, ["ep2_tp2_pp2_ckpt"], ranks=8, args=(moe_dir,))
    return four | eight | {"_dir": out}


def one_process(moe_dir, name: str, out=None) -> dict:
    rec, _ = tiny_run(init_from=str(moe_dir), **run_settings(name, out))
    return trained(rec)


@pytest.fixture(scope="module")
def reference(moe_dir, tmp_path_factory):
    """One process, micro-batches of 2, 6 steps (the resume's uninterrupted run)."""
    return one_process(moe_dir, "ep1_ckpt", tmp_path_factory.mktemp("pp_moe_reference"))


def test_the_pp4_layout_leaves_a_stage_without_a_mixture_of_experts_layer(moe_dir):
    config = source_config(moe_dir)
    assert config.moe_layers == (0, 2, 3) and layers_per_stage(config.num_layers, 4) == [1, 1, 1, 1]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", ["ep2_pp2", "pp4", "ep2_pp2_v2", "ep2_tp2_pp2_ckpt"])
def test_a_mixture_of_experts_over_pipeline_stages_trains_like_one_process(run, runs, reference):
    steps = len(runs[run]["losses"])
    assert_trains_like(runs[run], reference | {k: reference[k][:steps] for k in ("losses", "grad_norms")})
    experts = [name for name in reference["params"][5] if ".experts." in name]
    assert len(experts) == 3 * 3  # three MoE blocks of gate, up and down stacks, compared whole
    # rank 0 (the first stage) logs each step what the last stage computed, as one process logs it
    for logged, alone in zip(runs[run]["router_logs"], reference["router_logs"][:steps], strict=True):
        assert sorted(logged) == sorted(alone) and any(k.startswith("moe_tokens/blocks.3.mlp/") for k in logged)
        for key, value in alone.items():
            assert logged[key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.slow
@pytest.mark.distributed
def test_an_ep2_tp2_pp2_checkpoint_resumes_in_one_process_with_the_uninterrupted_losses(runs, reference, moe_dir):
    assert_resumes_like(one_process(moe_dir, "ep1_from_ep2_tp2_pp2_ckpt", runs["_dir"]), reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_an_ep2_tp2_pp2_checkpoint_exports_per_expert_keys_transformers_loads_with_our_logits(runs, tmp_path):
    checkpoint = runs["_dir"] / "ep2_tp2_pp2_ckpt" / "step=6.ckpt"
    out = tmp_path / "exported"
    assert export_main([str(checkpoint), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    assert exported_logits_gap(checkpoint, out, length=32) < 1e-5
