"""Expert parallelism (`expert_parallel: N`): the experts of each MoE layer split over N of the data-parallel
ranks, tokens sent to their experts and back by all-to-all. Specified by the groups it makes and by training: 5
steps from a Qwen 3-MoE directory (a dense layer among MoE ones, dropless, the auxiliary and z losses on)
reproduce one process in ep2 and ep4 on 4 ranks, in ep2 x tp2 with sequence parallelism on and off, in ep2 x cp2
(and cp2 with the experts whole), with every block recomputed (activation checkpointing), under gradient
accumulation, and in ep2 with ZeRO-1 and with ZeRO-3 (in bf16 within bf16's noise of data parallelism); an ep2
checkpoint resumes in one process and in ep4 with the uninterrupted losses (ZeRO-0, and ZeRO-3 into ep4 ZeRO-1),
ep2 x tp2 (SP), ep2 x cp2 and ep2 ZeRO-1 ones in one process, and each exports to a directory transformers loads."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import yaml
from dist_moe_runs import run_settings
from hf_models import exported_logits_gap, random_moe_dir
from parallel_harness import assert_resumes_like, assert_trains_like, launch_runs, tiny_run, trained

from mtnlg_lightning.interop.export_cli import main as export_main
from mtnlg_lightning.parallel.layout import ParallelLayout

STRATEGY = "mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy"
LAUNCH = ("ep2_ckpt", "ep4", "ep2_accum", "ep4_from_ep2_ckpt", "ep2_tp2", "ep2_tp2_sp_ckpt", "ep2_full")
LAUNCH += ("ep2_tp2_sp_full", "ep1_cp2", "ep2_cp2_ckpt", "ep2_z1_ckpt", "ep2_z3_ckpt", "ep4_z1_from_ep2_z3_ckpt")
LAUNCH += ("ep1_z1_bf16", "ep2_z1_bf16", "ep2_z3_bf16")  # one launch of 4 ranks


def test_expert_groups_are_runs_of_each_data_parallel_group():
    layout = ParallelLayout(8, tensor_parallel=2, expert_parallel=2)  # dp groups 0,2,4,6 and 1,3,5,7
    assert layout.expert_parallel_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert layout.expert_data_parallel_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert ParallelLayout(4, expert_parallel=4).expert_data_parallel_groups() == [[0], [1], [2], [3]]
    with_context = ParallelLayout(8, context_parallel=2, expert_parallel=2)  # rank = 2 dp + cp
    assert with_context.expert_parallel_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]  # the same cp rank's tokens
    assert with_context.expert_data_parallel_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]  # copies over DP x CP
    assert "ep group" in layout.table()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return random_moe_dir(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def runs(moe_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_runs")
    script = Path(__file__).resolve().parent / "dist_moe_runs.py"
    return launch_runs(script, out, list(LAUNCH), ranks=4, args=(moe_dir,)) | {"_dir": out}


def one_process(moe_dir, name: str, out=None) -> dict:
    rec, _ = tiny_run(init_from=str(moe_dir), **run_settings(name, out))
    return trained(rec)


@pytest.fixture(scope="module")
def references(moe_dir, tmp_path_factory):
    """One process: micro-batches of 2 (each the rows one of 4 ranks holds), 6 steps; micro-batches of 1, 5."""
    scratch = tmp_path_factory.mktemp("ep_reference")
    return {"micro2": one_process(moe_dir, "ep1_ckpt", scratch), "micro1": one_process(moe_dir, "ep1_accum")}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "run",
    ["ep2_ckpt", "ep4", "ep2_tp2", "ep2_tp2_sp_ckpt", "ep2_full", "ep2_tp2_sp_full", "ep1_cp2", "ep2_cp2_ckpt"]
    + ["ep2_z1_ckpt", "ep2_z3_ckpt"],
)
def test_expert_parallel_trains_like_one_process(run, runs, references):
    """ep2 x tp2: attention split over TP, experts whole on each TP rank; with SP each TP rank routes its slice of
    the sequence (the router's losses are the whole sequence's, its gradients summed over TP). _full: every block
    recomputed in the backward (the routing, its statistics' all-reduce and the all-to-alls run again). cp2: each
    sequence split over 2 ranks (their router statistics summed, the experts' gradients averaged over DP x CP).
    _zK: DeepSpeed ZeRO-K, which reduces the experts' gradients and partitions their state (ZeRO-3: the experts)
    over the ranks holding the same experts only."""
    steps = len(runs[run]["losses"])  # the reference ran 6 steps (for the resume), as ep2_ckpt did
    reference = references["micro2"]
    assert_trains_like(runs[run], reference | {k: reference[k][:steps] for k in ("losses", "grad_norms")})
    experts = [name for name in references["micro2"]["params"][5] if ".experts." in name]
    assert len(experts) == 2 * 3  # two MoE layers (layer 1 is dense) of gate, up and down stacks, compared whole


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_with_gradient_accumulation_trains_like_one_process(runs, references):
    assert_trains_like(runs["ep2_accum"], references["micro1"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("saved", ["ep2_ckpt", "ep2_tp2_sp_ckpt", "ep2_cp2_ckpt", "ep2_z1_ckpt", "ep2_z3_ckpt"])
def test_an_ep2_checkpoint_resumes_in_one_process_and_in_ep4_with_the_uninterrupted_losses(
    saved, runs, references, moe_dir
):
    """ep2, ep2 x tp2 with SP, ep2 x cp2 and ep2 under ZeRO-1 and ZeRO-3 save each expert whole (written by one
    rank of its copies over DP x CP, TP rank 0; under ZeRO its master weight and moments gathered from the
    partitions of those copies); one process resumes each, ep4 the ep2 one and (with ZeRO-1) the ZeRO-3 one."""
    uninterrupted = references["micro2"]
    resumed_alone = one_process(moe_dir, f"ep1_from_{saved}", runs["_dir"])
    in_ep4 = [run for name, run in runs.items() if name.startswith("ep4") and name.endswith(f"_from_{saved}")]
    assert len(in_ep4) == (saved in ("ep2_ckpt", "ep2_z3_ckpt"))
    for resumed in (resumed_alone, *in_ep4):
        assert_resumes_like(resumed, uninterrupted)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("saved", ["ep2_ckpt", "ep2_tp2_sp_ckpt", "ep2_cp2_ckpt", "ep2_z3_ckpt"])
def test_an_ep2_checkpoint_exports_per_expert_keys_transformers_loads_with_our_logits(saved, runs, tmp_path):
    pytest.importorskip("transformers")
    checkpoint = runs["_dir"] / saved / "step=6.ckpt"
    out = tmp_path / "exported"
    assert export_main([str(checkpoint), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    assert exported_logits_gap(checkpoint, out, length=32) < 1e-5


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", ["ep2_z1_bf16", "ep2_z3_bf16"])
def test_expert_parallel_under_zero_in_bf16_stays_within_bf16_noise_of_data_parallelism(run, runs):
    """bf16 weights with fp32 masters (DeepSpeed's bf16 optimizer at ZeRO-1, ZeRO-3's own), against dp4 ZeRO-1 in
    the same precision (the experts whole on every rank). Measured here: losses within 3.2e-5 (relative), gradient
    norms 1e-3, parameters 3.1e-3 apart at most, as far as dp4 ZeRO-3 is from dp4 ZeRO-1 (bf16 sums in another
    order). Averaging the experts over ranks holding other experts (the ZeRO groups left unmarked) moves the
    gradient norm by 1.3e-2 and the parameters by 0.40."""
    ran, reference = runs[run], runs["ep1_z1_bf16"]
    torch.testing.assert_close(ran["losses"], reference["losses"], rtol=1e-3, atol=0)
    torch.testing.assert_close(ran["grad_norms"], reference["grad_norms"], rtol=5e-3, atol=0)
    params, expected = ran["params"][5], reference["params"][5]
    assert max((params[k] - expected[k]).abs().max().item() for k in expected) <= 1e-2


@pytest.mark.slow
@pytest.mark.distributed
def test_a_trained_moe_checkpoint_generates_and_scores_in_expert_parallel_layouts_as_in_one_process(
    runs, tmp_path, capfd, monkeypatch
):
    """The ep2 ZeRO-3 checkpoint (6 steps trained) in ep2 on 2 ranks (each reads only its experts), in ep2 x tp2
    with SP and in ep2 x pp2 on 4: the same greedy text for three prompts of different lengths (dealt over the 2
    replicas, which pass in step, the one whose prompts end first passing a token through until the other ends) and
    the same perplexity (rel 1e-5) as one process. ep2 x pp2 scores micro-batches of 1 (each replica's batches
    padded to as many micro-batches as the others pass)."""
    from mtnlg_lightning.evaluation.cli import main as eval_main
    from mtnlg_lightning.inference.generate_cli import main as generate_main

    checkpoint = runs["_dir"] / "ep2_z3_ckpt" / "step=6.ckpt"
    text = tmp_path / "text.txt"
    text.write_text("Return the value of the argument. If the file does not exist, the function raises an error. " * 4)
    prompts = "The value of the argument is\nReturn\nIf the file does not exist, the function raises an error and\n"
    source = ["--checkpoint", str(checkpoint), "--dtype", "fp32"]
    greedy = ["--prompt", "-", "--max-new-tokens", "12", "--temperature", "0"]
    printed, perplexity = [], []
    ep2_pp2 = tmp_path / "ep2_pp2.yaml"  # written as `mtnlg fit` takes it
    init_args = {"expert_parallel": 2, "pipeline_parallel": 2, "zero_stage": 0}
    ep2_pp2.write_text(yaml.safe_dump({"class_path": STRATEGY, "init_args": init_args}))
    layouts = ([], ["--strategy", "strategy/ep2_zero1", "--devices", "2"])
    layouts += (["--strategy", "strategy/ep2_tp2_sp", "--devices", "4"], ["--strategy", str(ep2_pp2), "--devices", "4"])
    for where in layouts:
        monkeypatch.setattr("sys.stdin", io.StringIO(prompts))
        capfd.readouterr()
        assert generate_main([*source, *greedy, *where]) == 0
        out, err = capfd.readouterr()
        printed.append(out[out.index("--- prompt 1") :])  # the texts (after any library's start-up notice)
        assert ("experts over ep 2" in err) == bool(where)
        scores = tmp_path / f"perplexity{len(printed)}.json"
        scored = ["--task", "perplexity", "--data", str(text), "--stride", "16", "--no-progress"]
        scored += ["--output", str(scores), *(["--micro-batch-size", "1"] if str(ep2_pp2) in where else [])]
        assert eval_main([*source, *scored, *where]) == 0
        perplexity.append(json.loads(scores.read_text())["results"]["perplexity"]["-"]["perplexity"])
    assert printed[0].count("--- prompt") == 3 and all(made == printed[0] for made in printed[1:])
    assert all(value == pytest.approx(perplexity[0], rel=1e-5) for value in perplexity[1:])
