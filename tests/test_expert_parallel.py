"""Expert parallelism (`expert_parallel: N`): the experts of each MoE layer split over N of the data-parallel
ranks, tokens sent to their experts and back by all-to-all. Specified by the groups it makes and by training: 5
steps from a Qwen 3-MoE directory (a dense layer among MoE ones, dropless, the auxiliary and z losses on)
reproduce one process in ep2 and ep4 on 4 ranks, in ep2 x tp2 with sequence parallelism on and off, in ep2 x cp2
(and cp2 with the experts whole), with every block recomputed (activation checkpointing), under gradient
accumulation, and in ep2 with ZeRO-1 and with ZeRO-3 (in bf16 within bf16's noise of data parallelism); an ep2
checkpoint resumes in one process and in ep4 with the uninterrupted losses (ZeRO-0, and ZeRO-3 into ep4 ZeRO-1),
ep2 x tp2 (SP), ep2 x cp2 and ep2 ZeRO-1 ones in one process, and each exports to a directory transformers loads.
The sigmoid router (DeepSeek-V3's, its bias balanced after each step without a loss) trains alike in ep2, ep2 x tp2
with SP, ep2 x pp2 and ep2 ZeRO-3; its bias resumes, generates and scores in any layout and the export refuses it.
A DeepSeek-V3 directory (multi-head latent attention, group-limited routing, shared experts, a dense first block)
trains alike in ep2 x tp2 with SP on and off, ep2 x pp2, cp2 and ZeRO-3 over 4 ranks, in the same launch, and a
GLM-4.5 one in ep2 x tp2 with SP and cp2."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from deepseek_models import add_mtp_layers, random_deepseek_dir
from dist_moe_runs import ROUTER_LOSSES, SIGMOID_ROUTER, run_settings
from hf_models import exported_logits_gap, random_moe_dir
from lightning.pytorch import Callback

from mtnlg_lightning.checkpoint.model_state import read_model_state
from mtnlg_lightning.interop.export_cli import main as export_main
from mtnlg_lightning.parallel.layout import ParallelLayout
from testing.parallel_harness import assert_resumes_like, assert_trains_like, launch_runs, tiny_run, trained

STRATEGY = "mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy"
LAUNCH = ("ep2_ckpt", "ep4", "ep2_accum", "ep4_from_ep2_ckpt", "ep2_tp2", "ep2_tp2_sp_ckpt", "ep2_full")
LAUNCH += ("ep2_tp2_sp_full", "ep1_cp2", "ep2_cp2_ckpt", "ep2_z1_ckpt", "ep2_z3_ckpt", "ep4_z1_from_ep2_z3_ckpt")
LAUNCH += ("ep1_z1_bf16", "ep2_z1_bf16", "ep2_z3_bf16")
SIGMOID = (
    "sig_ep2_ckpt",
    "sig_ep2_tp2_sp_ckpt",
    "sig_ep2_pp2_ckpt",
    "sig_ep2_z3_ckpt",
    "sig_ep2_cp2_ckpt",
    "sig_ep2_full_ckpt",
)
LAUNCH += (*SIGMOID, "sig_ep4_from_sig_ep2_z3_ckpt")  # one launch of 4 ranks
# DeepSeek-V3 and GLM-4.5, in the same launch
MLA = ("mla_ep2_tp2", "mla_ep2_tp2_sp_ckpt", "mla_ep2_pp2", "mla_ep1_cp2", "mla_ep2_z3")
GLM = ("glm_ep2_tp2_sp", "glm_ep2_pp2", "glm_ep1_cp2", "glm_ep2_z3")
# DeepSeek-V3 with its multi-token prediction layer trained
MTP = ("mtp_ep2_tp2", "mtp_ep2_tp2_sp", "mtp_ep2_pp2", "mtp_tp2_pp2_sp", "mtp_ep1_cp2", "mtp_pp2_cp2", "mtp_ep2_z3")
LAUNCH += MLA + GLM + MTP
MOE_LAYERS = ("blocks.0.mlp", "blocks.2.mlp")  # block 1 is dense


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
def mla_dir(tmp_path_factory):
    return random_deepseek_dir(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3")


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return random_deepseek_dir(tmp_path_factory.mktemp("glm4_moe"), "glm4_moe")


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return add_mtp_layers(random_deepseek_dir(tmp_path_factory.mktemp("deepseek_v3_mtp"), "deepseek_v3"))


@pytest.fixture(scope="module")
def runs(moe_dir, mla_dir, glm_dir, mtp_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_runs")
    script = Path(__file__).resolve().parent / "dist_moe_runs.py"
    # the mla_ runs train the second, glm_ the third, mtp_ the fourth
    sources = os.pathsep.join(map(str, (moe_dir, mla_dir, glm_dir, mtp_dir)))
    return launch_runs(script, out, list(LAUNCH), ranks=4, args=(sources,)) | {"_dir": out}


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
@pytest.mark.parametrize("run", MLA)
def test_the_deepseek_v3_class_trains_like_one_process(run, runs, mla_reference):
    """Multi-head latent attention under TP (heads split; the latents whole, on the sequence shard under SP, the
    rotary key's gradient summed over TP), PP, CP (the values padded to the q/k width for the ring) and ZeRO-3, with
    DeepSeek-V3's routing beside EP: 5 steps as one process takes them (losses rel 1e-6, parameters 2e-5)."""
    steps = len(runs[run]["losses"])  # the reference ran 6 steps (for the resume), as the _ckpt run did
    assert_trains_like(runs[run], mla_reference | {k: mla_reference[k][:steps] for k in ("losses", "grad_norms")})


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", MTP)
def test_multi_token_prediction_trains_like_one_process(run, runs, mtp_reference):
    """DeepSeek-V3 read with its MTP layer (mtp_layers 1): the depth's block sharded over TP as the trunk's, its
    experts over EP, the shared head vocabulary-parallel inside the loss (SP: the depth on each rank's sequence
    slice, its own layers' gradients summed over TP); under PP the depth on the last stage with
    a copy of the embedding (its gradient sent back to the first stage's, as a tied head's), the tokens handed to
    that stage; under CP each rank's chunks read their tokens ahead from the whole rows, the depth's block attends
    through the ring; ZeRO-3 gathers the shared head for each depth's loss as for the main one. The main + MTP
    losses, gradient norms and parameters after 5 steps are one process's."""
    assert_trains_like(runs[run], mtp_reference)


@pytest.fixture(scope="module")
def mtp_reference(mtp_dir):
    """One process, 5 steps, the MTP layer trained (mtp_layers 1)."""
    return one_process(mtp_dir, "mtp_ep1")


@pytest.fixture(scope="module")
def mla_reference(mla_dir, tmp_path_factory):
    """One process, 6 steps (saved at 3 and 6)."""
    return one_process(mla_dir, "mla_ep1_ckpt", tmp_path_factory.mktemp("mla_reference"))


@pytest.mark.slow
@pytest.mark.distributed
def test_an_mla_checkpoint_of_ep2_x_tp2_with_sp_resumes_in_one_process_and_exports_with_our_logits(
    runs, mla_reference, mla_dir, tmp_path
):
    """The step-3 checkpoint of ep2 x tp2 with SP (heads split, the latents and the rotary key whole on each rank,
    the experts split) resumes in one process with the uninterrupted losses; the step-6 one exports to a
    DeepseekV3ForCausalLM directory (the trained routers' biases as e_score_correction_bias) with our logits."""
    assert_resumes_like(one_process(mla_dir, "mla_ep1_from_mla_ep2_tp2_sp_ckpt", runs["_dir"]), mla_reference)
    checkpoint = runs["_dir"] / "mla_ep2_tp2_sp_ckpt" / "step=6.ckpt"
    out = tmp_path / "exported"
    assert export_main([str(checkpoint), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    assert read_model_state(checkpoint).weights["blocks.1.mlp.expert_bias"].abs().sum() > 0  # it moved
    assert exported_logits_gap(checkpoint, out, length=32) < 1e-5


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", GLM)
def test_the_glm_4_5_class_trains_like_one_process(run, runs, glm_reference):
    """GLM-4.5 (q/k/v biases, per-head q/k norms, half of each head rotating; DeepSeek-V3's routing) in ep2 x tp2
    with SP, ep2 x pp2, cp2 and ep2 with ZeRO-3 as one process."""
    assert_trains_like(runs[run], glm_reference)


@pytest.fixture(scope="module")
def glm_reference(glm_dir):
    return one_process(glm_dir, "glm_ep1")


@pytest.fixture(scope="module")
def sigmoid_reference(moe_dir, tmp_path_factory):
    """One process, the sigmoid router: 6 steps, saved at 3 and 6 (its checkpoints under `_dir`)."""
    scratch = tmp_path_factory.mktemp("sigmoid_reference")
    return one_process(moe_dir, "sig_ep1_ckpt", scratch) | {"_dir": scratch / "sig_ep1_ckpt"}


def expert_biases(checkpoint: Path) -> dict[str, torch.Tensor]:
    weights = read_model_state(checkpoint).weights
    return {layer: weights[f"{layer}.expert_bias"] for layer in MOE_LAYERS}


def bias_from_logged_loads(router_logs: list[dict], rate: float = 0.01) -> dict[str, torch.Tensor]:
    """The bias the update rule makes of each step's logged tokens per expert: + rate under the mean, - over it."""
    out = {}
    for layer in MOE_LAYERS:
        bias = torch.zeros(4)
        for logs in router_logs:
            loads = torch.tensor([logs[f"moe_tokens/{layer}/expert_{e}"] for e in range(4)], dtype=torch.float64)
            bias += rate * torch.sign(loads.mean() - loads).float()
        out[layer] = bias
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", SIGMOID)
def test_the_sigmoid_router_and_its_balancing_bias_train_like_one_process(run, runs, sigmoid_reference):
    """DeepSeek-V3's router: each layer's bias moves after every step by the step's load over every micro-batch and
    rank, so every replica, TP rank and pipeline stage holds the one-process bias; the runs reproduce one process's
    losses, gradients, router logs and, in their step-6 checkpoints, its biases. The bias did move (by the rule,
    from the logged loads), and it changes routing: the losses of steps 2-6 differ from a run whose bias stays 0."""
    assert_trains_like(runs[run], sigmoid_reference)
    for ran, expected in zip(runs[run]["router_logs"], sigmoid_reference["router_logs"], strict=True):
        assert ran.keys() == expected.keys()
        assert all(ran[k] == pytest.approx(expected[k], rel=1e-5) for k in expected)
    biases = expert_biases(runs["_dir"] / run / "step=6.ckpt")
    expected = expert_biases(sigmoid_reference["_dir"] / "step=6.ckpt")
    assert all(torch.equal(biases[layer], expected[layer]) for layer in MOE_LAYERS)
    from_logs = bias_from_logged_loads(sigmoid_reference["router_logs"])
    assert all(torch.allclose(expected[layer], from_logs[layer], rtol=0, atol=1e-6) for layer in MOE_LAYERS)
    assert all(expected[layer].abs().sum() > 0 for layer in MOE_LAYERS)


@pytest.mark.slow
def test_the_expert_bias_changes_which_experts_tokens_go_to(moe_dir, sigmoid_reference):
    """The same one-process run with the bias left at 0 (rate 0): step 1 routes alike, the later steps do not."""
    overrides = ROUTER_LOSSES | SIGMOID_ROUTER | {"router_bias_update_rate": 0.0}
    rec, _ = tiny_run(init_from=str(moe_dir), micro_batch_size=2, max_steps=6, model_overrides=overrides)
    fixed, balanced = torch.tensor(rec.losses), torch.tensor(sigmoid_reference["losses"])
    assert fixed[0] == balanced[0]
    assert ((fixed[1:] - balanced[1:]).abs() / balanced[1:]).max() > 1e-5  # the layout tests' tolerance is 1e-6


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


class VetoThirdUpdate(Callback):
    """Vetoes the third step's update (as the loss-spike detector's skip does) and keeps each step's biases."""

    def __init__(self):
        self.asked, self.biases = 0, []

    def should_skip_update(self, trainer, pl_module, loss, grad_norm) -> bool:
        self.asked += 1
        return self.asked == 3

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.biases.append(torch.cat([pl_module.model.get_submodule(n).expert_bias.clone() for n in MOE_LAYERS]))


@pytest.mark.slow
def test_a_vetoed_step_leaves_the_expert_bias_as_it_was(moe_dir):
    veto = VetoThirdUpdate()
    overrides = ROUTER_LOSSES | SIGMOID_ROUTER
    tiny_run(init_from=str(moe_dir), micro_batch_size=2, max_steps=4, model_overrides=overrides, callbacks=[veto])
    first, second, third, fourth = veto.biases
    assert not torch.equal(first, second) and not torch.equal(third, fourth)  # the bias moves after each step
    assert torch.equal(second, third)  # but not after a step whose update was vetoed


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sigmoid_router_checkpoint_resumes_its_bias_in_one_process_and_in_ep4(runs, sigmoid_reference, moe_dir):
    """The ep2 ZeRO-3 step-3 checkpoint holds each layer's bias (fp32, written once); one process and ep4 (ZeRO-0)
    read it back and continue with the uninterrupted losses of steps 4-6, whose routing the bias decides."""
    resumed_alone = one_process(moe_dir, "sig_ep1_from_sig_ep2_z3_ckpt", runs["_dir"])
    for resumed in (resumed_alone, runs["sig_ep4_from_sig_ep2_z3_ckpt"]):
        assert_resumes_like(resumed, sigmoid_reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_trained_sigmoid_router_model_generates_and_scores_with_its_bias_in_ep2_as_in_one_process(
    runs, tmp_path, capfd, monkeypatch
):
    """The ep2 ZeRO-3 sigmoid checkpoint (6 steps trained): loaded, every router holds the trained bias; in ep2 on 2
    ranks it gives one process's greedy text and perplexity; the export refuses it in one line (no family it
    writes routes this way) and writes nothing."""
    from mtnlg_lightning.evaluation.cli import main as eval_main
    from mtnlg_lightning.inference.generate_cli import main as generate_main
    from mtnlg_lightning.inference.load import load_model

    checkpoint = runs["_dir"] / "sig_ep2_z3_ckpt" / "step=6.ckpt"
    model, _ = load_model(checkpoint)
    trained_bias = expert_biases(checkpoint)
    for layer in MOE_LAYERS:
        held = model.get_submodule(layer).expert_bias
        assert held.dtype == torch.float32 and torch.equal(held, trained_bias[layer]) and held.abs().sum() > 0
    text = tmp_path / "text.txt"
    text.write_text("Return the value of the argument. If the file does not exist, the function raises an error. " * 4)
    prompts = "The value of the argument is\nReturn\nIf the file does not exist, the function raises an error and\n"
    source = ["--checkpoint", str(checkpoint), "--dtype", "fp32"]
    printed, perplexity = [], []
    for where in ([], ["--strategy", "strategy/ep2_zero1", "--devices", "2"]):
        monkeypatch.setattr("sys.stdin", io.StringIO(prompts))
        capfd.readouterr()
        assert generate_main([*source, "--prompt", "-", "--max-new-tokens", "12", "--temperature", "0", *where]) == 0
        out = capfd.readouterr().out
        printed.append(out[out.index("--- prompt 1") :])
        scores = tmp_path / f"perplexity{len(printed)}.json"
        scored = ["--task", "perplexity", "--data", str(text), "--stride", "16", "--no-progress"]
        assert eval_main([*source, *scored, "--output", str(scores), *where]) == 0
        perplexity.append(json.loads(scores.read_text())["results"]["perplexity"]["-"]["perplexity"])
    assert printed[0].count("--- prompt") == 3 and printed[1] == printed[0]
    assert perplexity[1] == pytest.approx(perplexity[0], rel=1e-5)
    capfd.readouterr()
    assert export_main([str(checkpoint), str(tmp_path / "exported")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names none (a custom block)" in err[0] and not (tmp_path / "exported").exists()
