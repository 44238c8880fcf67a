"""Muon (`--model.optimizer muon`, `parallel/muon.py`): torch.optim.Muon's step for the hidden matrices, each
logical matrix whole (Q, K and V of a fused QKV weight, each expert), AdamW for the rest, in every layout."""

from __future__ import annotations

import re

import pytest
import torch

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.model import build_model
from mtnlg_lightning.parallel.muon import MuonSettings
from mtnlg_lightning.train.optimizer_recipe import build_muon, muon_split

LR, DECAY, BETAS, EPS = 2e-3, 0.1, (0.9, 0.95), 1e-8
MOE = dict(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=32, shared_expert_ffn_hidden_size=48)


def _models():
    """A fused-QKV GPT (Q, K, V in one weight) and a Qwen 2-style MoE (stacked experts, a router, a shared expert
    and its gate), fp32."""
    return {"gpt": get_config("tiny"), "moe": get_config("tiny-llama", family=None, **MOE)}


def _loss(model, config, step: int) -> torch.Tensor:
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


class ReferenceSplit:
    """torch.optim.Muon and torch.optim.AdamW on the parameter split of `muon_split`, the fused QKV weights and the
    stacked experts cut into one leaf matrix each (their values and gradients copied in, the results copied back):
    what the unfused model would step."""

    def __init__(self, model, config, settings: dict):
        decay, no_decay, hidden, stacked = muon_split(model)
        names = {id(p): n for n, p in model.named_parameters()}
        self.pieces = []  # (parameter, a function giving the view of one matrix, its leaf [rows, cols])
        for param in hidden + stacked:
            if param.dim() == 3:
                views = [lambda t, e=e: t[e] for e in range(param.shape[0])]
            elif names[id(param)].endswith("qkv.weight"):  # rows [heads, 3, head_dim]
                hd, cols = config.head_dim, param.shape[1]
                views = [lambda t, i=i, hd=hd, cols=cols: t.view(-1, 3, hd, cols)[:, i] for i in range(3)]
            else:
                views = [lambda t: t]
            for view in views:
                leaf = view(param.detach()).reshape(-1, param.shape[-1]).clone()
                self.pieces.append((param, view, torch.nn.Parameter(leaf)))
        self.muon = torch.optim.Muon([leaf for *_, leaf in self.pieces], **settings)
        self.adamw = torch.optim.AdamW(
            [{"params": decay, "weight_decay": DECAY}, {"params": no_decay, "weight_decay": 0.0}],
            lr=LR,
            betas=BETAS,
            eps=EPS,
        )

    @torch.no_grad()
    def step(self) -> None:
        for param, view, leaf in self.pieces:
            leaf.copy_(view(param.detach()).reshape(leaf.shape))
            leaf.grad = view(param.grad).reshape(leaf.shape).clone()
        self.muon.step()
        self.adamw.step()
        for param, view, leaf in self.pieces:
            view(param.data).copy_(leaf.view_as(view(param.data)))


@pytest.mark.parametrize("family", ["gpt", "moe"])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_five_steps_equal_torch_muon_and_adamw_on_the_same_split(family, adjust_lr):
    """One process, fp32, 5 steps: every parameter within 1e-6 of torch.optim.Muon (hidden matrices, Q, K and V of
    the fused QKV weight and each expert separately) plus torch.optim.AdamW (embeddings, head, norms, biases,
    router, shared-expert gate)."""
    config = _models()[family]
    torch.manual_seed(0)
    ours = build_model(config)
    theirs = build_model(config)
    theirs.load_state_dict(ours.state_dict())
    muon = {"lr": 0.02, "weight_decay": 0.05, "momentum": 0.9, "adjust_lr": adjust_lr}
    optimizer = build_muon(ours, MuonSettings.from_dict(muon), LR, DECAY, BETAS, EPS, None, config.head_dim)
    torch_settings = dict(lr=0.02, weight_decay=0.05, momentum=0.9, adjust_lr_fn=adjust_lr)
    reference = ReferenceSplit(theirs, config, torch_settings)
    for step in range(5):
        for model, opt in ((ours, optimizer), (theirs, reference)):
            _loss(model, config, step).backward()
            opt.step()
            model.zero_grad(set_to_none=True)
    expected = dict(theirs.named_parameters())
    apart = {name: (p - expected[name]).abs().max().item() for name, p in ours.named_parameters()}
    assert max(apart.values()) <= 1e-6, sorted(apart.items(), key=lambda kv: -kv[1])[:3]
    moved = {
        name: (p - q).abs().max().item() for (name, p), q in zip(ours.named_parameters(), _initial(config), strict=True)
    }
    assert min(moved.values()) > 0  # every parameter trained


def _initial(config):
    torch.manual_seed(0)
    return [p.detach() for p in build_model(config).parameters()]


def test_the_split_sends_hidden_matrices_and_experts_to_muon_and_the_rest_to_adamw():
    """Moonlight's recipe plus the routers: Muon for attention and MLP projections (dense and shared expert) and
    the stacked experts; AdamW with decay for the embeddings, the LM head, the router and the shared-expert gate;
    AdamW without decay for norms and biases."""
    model = build_model(_models()["moe"])
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay, hidden, stacked = ([names[id(p)] for p in group] for group in muon_split(model))
    block = "blocks.0."
    assert [n for n in decay if not n.startswith("blocks.1.")] == [
        "embed.wte.weight",
        "blocks.0.mlp.router.weight",
        "blocks.0.mlp.shared_gate.weight",
        "lm_head.weight",
    ]
    assert [n for n in no_decay if n.startswith(block)] == ["blocks.0.ln1.weight", "blocks.0.ln2.weight"]
    assert [n.removeprefix(block) for n in hidden if n.startswith(block)] == [
        f"{m}.weight" for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.shared.gate", "mlp.shared.up")
    ] + ["mlp.shared.down.weight"]
    assert [n.removeprefix(block) for n in stacked if n.startswith(block)] == [
        f"mlp.experts.{m}.weight" for m in ("gate", "up", "down")
    ]


@pytest.mark.parametrize(
    ("muon", "message"),
    [
        ({"adjust_lr": "spectral"}, "model.muon.adjust_lr 'spectral' is not one of original, match_rms_adamw"),
        ({"ns_coefficients": [1, 2]}, "model.muon.ns_coefficients takes 3 numbers, got 2"),
        ({"ns_steps": 0}, "model.muon.ns_steps must be in [1, 100), got 0"),
        ({"momentum": 1.0}, "model.muon.momentum must be in [0, 1), got 1.0"),
        ({"lr": -1.0}, "model.muon.lr must be >= 0, got -1.0"),
        ({"beta": 0.9}, "model.muon has no setting 'beta'"),
        ({"ns_dtype": "float16"}, "model.muon.ns_dtype 'float16' is not one of bfloat16, float32"),
    ],
)
def test_bad_muon_settings_are_one_line(muon, message):
    with pytest.raises(MTNLGError, match="^" + re.escape(message)):
        MuonSettings.from_dict(muon)


def test_the_module_refuses_another_optimizer_muon_settings_without_muon_and_muon_with_lora():
    from mtnlg_lightning.train.module import MTNLGModule

    with pytest.raises(MTNLGError, match="^model.optimizer 'sgd' is not one of adamw, muon$"):
        MTNLGModule(optimizer="sgd")
    with pytest.raises(MTNLGError, match="^model.muon is set, but model.optimizer is not muon$"):
        MTNLGModule(muon={"lr": 0.02})
    with pytest.raises(MTNLGError, match="^model.optimizer muon does not train LoRA adapters"):
        MTNLGModule(optimizer="muon", lora={"rank": 4})


# ------------------------------------------------------------------------------------------------ checkpoints
MUON_RUN = {"optimizer": "muon", "muon": {"lr": 0.01, "adjust_lr": "original"}}


@pytest.fixture(scope="module")
def muon_checkpoints(tmp_path_factory):
    """A one-process Muon run of 6 steps saving at 3 and 6, and an AdamW run's step-3 checkpoint."""
    from testing.parallel_harness import tiny_run, trained

    root = tmp_path_factory.mktemp("muon_ckpt")
    rec, _ = tiny_run(max_steps=6, capture_steps=(6,), checkpoint_dir=root / "muon", module_settings=MUON_RUN)
    tiny_run(max_steps=3, capture_steps=(), checkpoint_dir=root / "adamw")
    return {"root": root, "muon": trained(rec)}


def test_a_muon_checkpoint_holds_one_momentum_buffer_per_matrix_and_resumes_with_the_uninterrupted_losses(
    muon_checkpoints,
):
    """The momentum buffers are model-space tensors `optim/NAME/momentum_buffer` (the AdamW groups' moments beside
    them); a resume at step 3 continues the uninterrupted run (losses rel 1e-5, parameters 2e-5)."""
    from mtnlg_lightning.checkpoint.format import read_manifest
    from testing.parallel_harness import assert_resumes_like, tiny_run, trained

    step3 = muon_checkpoints["root"] / "muon" / "step=3.ckpt"
    tensors = read_manifest(step3)["tensors"]
    assert "optim/blocks.0.attn.qkv.weight/momentum_buffer" in tensors
    assert "optim/blocks.0.attn.qkv.weight/exp_avg" not in tensors
    assert {"optim/embed.wte.weight/exp_avg", "optim/blocks.0.ln1.weight/exp_avg_sq"} <= set(tensors)
    rec, _ = tiny_run(max_steps=6, capture_steps=(6,), ckpt_path=step3, module_settings=MUON_RUN)
    assert_resumes_like(trained(rec), muon_checkpoints["muon"])


@pytest.mark.parametrize(("source", "settings"), [("adamw", MUON_RUN), ("muon", {})])
def test_another_optimizers_checkpoint_is_refused_in_one_line_unless_the_optimizer_is_reset(
    muon_checkpoints, source, settings
):
    """An AdamW checkpoint resumed with Muon, or a Muon one with AdamW: one line naming both; with
    `reset_optimizer` the run goes on from the checkpoint's weights and step with a fresh optimizer of its own."""
    from mtnlg_lightning.checkpoint.format import CheckpointError
    from mtnlg_lightning.checkpoint.state_io import optimizer_name
    from testing.parallel_harness import tiny_run

    step3 = muon_checkpoints["root"] / source / "step=3.ckpt"
    other = "muon" if source == "adamw" else "adamw"
    message = f"^the checkpoint's optimizer is {source} and this run's {other}: resume with --model.optimizer {source}"
    with pytest.raises(CheckpointError, match=message):
        tiny_run(max_steps=4, capture_steps=(), ckpt_path=step3, module_settings=settings)
    rec, trainer = tiny_run(
        max_steps=4, capture_steps=(), ckpt_path=step3, module_settings={**settings, "reset_optimizer": True}
    )
    assert trainer.global_step == 4 and len(rec.losses) == 1 and optimizer_name(trainer.optimizers[0]) == other


# ------------------------------------------------------------------------------------------------ layouts
WORLD2 = ("gpt_tp2_sp", "gpt_pp2", "gpt_dp2", "gpt_tp2_alone", "gpt_tp2_sp_bf16ns", "moe_ep2", "moe_tp2_sp")
WORLD2 += ("moe_pp2",)
WORLD2 += ("gpt_tp2_sp_ckpt", "gpt_dp2_from_gpt_tp2_sp_ckpt", "gpt_pp2_from_gpt_tp2_sp_ckpt", "gpt_dp2_ckpt")
WORLD2 += ("gpt_tp2_sp_from_gpt_dp2_ckpt", "gpt_tp2_sp_qk", "gpt_pp2_qk", "gpt_dp2_qk", "gpt_cp2_qk", "gpt_cp2")
WORLD2 += ("adamw_tp2_ckpt", "gpt_dp2_reset_from_adamw_tp2_ckpt")
# DeepSpeed ZeRO (gpt: _zeroN, the MoE directory: _zN)
ZERO = ("gpt_dp2_zero1", "gpt_dp2_zero2", "gpt_dp2_zero3", "gpt_dp2_zero3_subgroups", "moe_ep2_z2", "moe_ep1_z3")
WORLD2 += (*ZERO, "gpt_dp2_zero3_from_gpt_tp2_sp_ckpt", "gpt_dp2_zero1_ckpt", "gpt_tp2_sp_from_gpt_dp2_zero1_ckpt")
WORLD2 += ("gpt_dp2_zero3_ckpt", "gpt_dp2_zero2_from_gpt_dp2_zero3_ckpt")
WORLD2 += ("gpt_dp2_bf16_bf16ns", "gpt_dp2_zero1_bf16_fp32acc_bf16ns", "gpt_dp2_zero3_bf16_bf16ns")
WORLD8 = ("gpt_tp2_pp2_dp2", "moe_ep2_tp2_pp2", "gpt_tp2_pp2_dp2_zero1", "gpt_tp2_cp2_zero3")


@pytest.fixture(scope="module")
def muon_moe_dir(tmp_path_factory):
    from hf_models import random_moe_dir

    return random_moe_dir(tmp_path_factory.mktemp("muon_qwen3_moe"), "qwen3_moe")


def _one_process(name: str, moe_dir, out) -> dict:
    from dist_muon_runs import run_settings

    from testing.parallel_harness import tiny_run, trained

    rec, trainer = tiny_run(**run_settings(name, out, str(moe_dir)))
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("qk_")}
    return trained(rec) | {"qk_logs": logged}


@pytest.fixture(scope="module")
def muon_references(muon_moe_dir, tmp_path_factory):
    """One process: the tiny GPT (6 steps, for the resumes too) and the Qwen 3-MoE directory (micro-batches of 2)."""
    out = tmp_path_factory.mktemp("muon_reference")
    return {
        "gpt": _one_process("gpt_ckpt", muon_moe_dir, out),
        "gpt_bf16ns": _one_process("gpt_bf16ns", muon_moe_dir, out),
        "gpt_qk": _one_process("gpt_qk", muon_moe_dir, out),
        "moe": _one_process("moe_ep1", muon_moe_dir, out),
    }


def _launch(ranks: int, names: tuple[str, ...], moe_dir, tmp_path_factory) -> dict:
    from pathlib import Path

    from testing.parallel_harness import launch_runs

    script = Path(__file__).resolve().parent / "dist_muon_runs.py"
    out = tmp_path_factory.mktemp(f"muon_world{ranks}")
    return launch_runs(script, out, list(names), ranks=ranks, args=(str(moe_dir),)) | {"_dir": out}


@pytest.fixture(scope="module")
def muon_world2(muon_moe_dir, tmp_path_factory):
    return _launch(2, WORLD2, muon_moe_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def muon_world8(muon_moe_dir, tmp_path_factory):
    return _launch(8, WORLD8, muon_moe_dir, tmp_path_factory)


def _apart(run: dict, reference: dict, step: int = 5) -> float:
    params, expected = run["params"][step], reference["params"][step]
    assert params.keys() == expected.keys()
    return max((params[k] - expected[k]).abs().max().item() for k in expected)


def assert_muon_trains_like(run: dict, reference: dict) -> None:
    """The first 5 steps' losses (rel 1e-5) and the parameters after step 5 (2e-5)."""
    torch.testing.assert_close(run["losses"][:5], reference["losses"][:5], rtol=1e-5, atol=0)
    assert _apart(run, reference) <= 2e-5


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "run",
    [
        n
        for n in WORLD2
        if n.startswith(("gpt", "moe")) and not any(s in n for s in ("alone", "from", "bf16ns", "qk", "_z"))
    ],
)
def test_muon_trains_like_one_process_in_every_layout(run, muon_world2, muon_references):
    """tp2 with sequence parallelism (each TP-split matrix gathered and orthogonalised whole; the fused QKV's
    shards hold whole heads, so Q, K and V come back whole), pp2 (each stage its own matrices), dp2 (plain DP:
    every replica steps the same reduced gradients), the Qwen 3-MoE directory in ep2 (each expert one matrix on
    the rank holding it), in tp2 with SP (grouped-query q / k / v column-split, experts whole on each TP rank) and
    in pp2, and cp2 (the dense matrices shared out over the DP x CP replicas): 5 steps reproduce one process."""
    assert_muon_trains_like(muon_world2[run], muon_references[run.split("_")[0]])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", ZERO)
def test_muon_under_deepspeed_zero_trains_like_one_process(run, muon_world2, muon_references):
    """dp2 under DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3, Muon as DeepSpeed's client optimizer on its flat fp32
    partitions: each rank keeps the momentum of its partition (half the hidden matrices' elements, no matrix
    whole), orthogonalises the 4 of the tiny GPT's 8 hidden matrices it owns whole (gathered from both ranks'
    pieces) and sends the updates back (ZeRO-3 also in sub-groups of 20k parameters, each stepped apart); the
    Qwen 3-MoE directory too, in ep2 under ZeRO-2 (each rank's experts partitioned over the ranks holding them:
    itself) and dp2 under ZeRO-3 (the experts partitioned over both): 5 steps reproduce one process (losses rel
    1e-5, parameters 2e-5, fp32)."""
    result = muon_world2[run]
    assert_muon_trains_like(result, muon_references[run.split("_")[0]])
    if run.startswith("gpt"):
        assert result["zero_orthogonalised"] == [4, 4]
        whole = muon_world2["gpt_dp2"]["momentum_elements"]  # plain DP: each replica keeps its 4 matrices whole
        assert sum(result["momentum_elements"]) == sum(whole)
        assert max(result["momentum_elements"]) - min(result["momentum_elements"]) <= 2
    else:  # 15 dense matrices and 2 x 3 expert stacks (each expert one matrix) in all
        assert sum(result["zero_orthogonalised"]) == 15 + (6 if "ep1" in run else 2 * 6)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("run", "zero_optimizer"),
    [
        ("gpt_dp2_zero1_bf16_fp32acc_bf16ns", "BF16_Optimizer"),
        ("gpt_dp2_zero3_bf16_bf16ns", "DeepSpeedZeroOptimizer_Stage3"),
    ],
)
def test_muon_under_zero_runs_in_bf16(run, zero_optimizer, muon_world2):
    """bf16-mixed with torch's bf16 Newton-Schulz (the pieces move in bf16) under ZeRO-1 accumulating fp32 gradients
    (DeepSpeed's BF16_Optimizer, its own flat partitions) and ZeRO-3: the losses follow plain DP's bf16 run within
    bf16's rounding (ZeRO keeps bf16 weights beside its fp32 masters, Lightning's bf16-mixed fp32 ones), rel 1e-3,
    and fall."""
    assert muon_world2[run]["optimizer"] == zero_optimizer
    losses, plain = muon_world2[run]["losses"], muon_world2["gpt_dp2_bf16_bf16ns"]["losses"]
    torch.testing.assert_close(losses, plain, rtol=1e-3, atol=0)
    assert losses[4] < losses[0] - 0.05


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "run",
    [
        "gpt_dp2_zero3_from_gpt_tp2_sp_ckpt",
        "gpt_tp2_sp_from_gpt_dp2_zero1_ckpt",
        "gpt_dp2_zero2_from_gpt_dp2_zero3_ckpt",
    ],
)
def test_a_muon_checkpoint_resumes_across_zero_stages_with_the_uninterrupted_losses(run, muon_world2, muon_references):
    """The momentum buffers move between ZeRO's partitions and the layout-independent checkpoint: a tp2 + SP run's
    step-3 checkpoint resumed in dp2 ZeRO-3, a dp2 ZeRO-1 one in tp2 + SP, a dp2 ZeRO-3 one in dp2 ZeRO-2, continue
    the uninterrupted one-process run (steps 4-6: losses rel 1e-5, parameters 2e-5)."""
    from testing.parallel_harness import assert_resumes_like

    assert_resumes_like(muon_world2[run], muon_references["gpt"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", WORLD8)
def test_muon_trains_like_one_process_in_three_dimensions(run, muon_world8, muon_references):
    """8 ranks: the tiny GPT in tp2 x pp2 x dp2 (ZeRO-0 and ZeRO-1: the owners of a TP-split matrix's pieces
    orthogonalise it with their TP peers; the last stage, whose LM head is the embedding's copy, cuts its Muon group
    in two so that DeepSpeed sees as many groups as on the first) and tp2 x cp2 x dp2 under ZeRO-3 (each matrix in
    pieces over 4 ranks), the Qwen 3-MoE directory in ep2 x tp2 x pp2 (dp2), reproduce one process."""
    assert_muon_trains_like(muon_world8[run], muon_references[run.split("_")[0]])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tensor_parallel_shard_orthogonalised_alone_is_not_one_process_muon(muon_world2, muon_references):
    """The same tp2 run orthogonalising each TP shard as a matrix of its own (Megatron's `blockwise`): after 5 steps
    its parameters are ~1e-2 from one process's and its loss 0.3% off (the layouts' noise in fp32: ~2e-6)."""
    alone, reference = muon_world2["gpt_tp2_alone"], muon_references["gpt"]
    assert _apart(alone, reference) > 5e-3
    assert abs(alone["losses"][4] - reference["losses"][4]) > 1e-2


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_replicas_share_the_dense_matrices_out_and_every_expert_holder_steps_its_experts(
    muon_world2, muon_references
):
    """Under dp2 each replica keeps the momentum of half the dense matrices (the tiny GPT's 8: 4 each) and steps
    only those; under tp2 each TP rank orthogonalises half of them whole; under ep2 (the Qwen 3-MoE directory: 3
    blocks, blocks 0 and 2 MoE) the 15 dense matrices (q, k, v, proj of each block, block 1's MLP) are shared out
    and each rank steps its own experts (2 layers x 3 stacks)."""
    assert muon_world2["gpt_dp2"]["momentum_buffers"] == [4, 4]
    assert muon_world2["gpt_tp2_sp"]["momentum_buffers"] == [8, 8]  # TP ranks hold different shards: all of them
    assert muon_world2["gpt_tp2_sp"]["tp_orthogonalised"] == [4, 4]  # each TP rank orthogonalises half, whole
    held = muon_world2["moe_ep2"]["momentum_buffers"]
    assert sum(held) == 15 + 2 * 6 and min(held) > 6


@pytest.mark.slow
@pytest.mark.distributed
def test_in_bf16_the_layouts_noise_stays_far_below_a_shard_orthogonalised_alone(muon_world2, muon_references):
    """Torch's bf16 Newton-Schulz rounds the fp32 noise of tp2's re-ordered sums into differences of a few 1e-4
    after 5 steps (fp32: ~2e-6); a shard orthogonalised alone is 1e-2 away."""
    assert _apart(muon_world2["gpt_tp2_sp_bf16ns"], muon_references["gpt_bf16ns"]) <= 2e-3


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "run", ["gpt_dp2_from_gpt_tp2_sp_ckpt", "gpt_pp2_from_gpt_tp2_sp_ckpt", "gpt_tp2_sp_from_gpt_dp2_ckpt"]
)
def test_a_muon_checkpoint_resumes_in_another_layout_with_the_uninterrupted_losses(run, muon_world2, muon_references):
    """The momentum buffers are saved whole in model space (under DP each by the replica holding it): a tp2 + SP
    run's step-3 checkpoint resumed in dp2 and in pp2, a dp2 run's in tp2 + SP, continue the uninterrupted
    one-process run (steps 4-6: losses rel 1e-5, parameters 2e-5)."""
    from testing.parallel_harness import assert_resumes_like

    assert_resumes_like(muon_world2[run], muon_references["gpt"])


# ------------------------------------------------------------------------------------------------ QK-clip
def _planted(preset: str, head: int = 1, factor: float = 20.0):
    """A model (random biases) whose block-0 query head `head` has its query weights `factor` times larger, its
    per-head maxima on a batch, and that batch."""
    from mtnlg_lightning.parallel.qk_clip import QKClip

    config = get_config(preset)
    torch.manual_seed(0)
    model = build_model(config)
    hd = config.head_dim
    with torch.no_grad():
        for name, param in model.named_parameters():  # non-zero biases: the clip must scale the query's too
            if name.endswith("bias"):
                param.uniform_(-0.5, 0.5)
        if config.fused_qkv:
            model.blocks["0"].attn.qkv.weight.view(config.num_heads, 3, hd, -1)[head, 0] *= factor
        else:
            model.blocks["0"].attn.q.weight.view(config.num_heads, hd, -1)[head] *= factor
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    clipper = QKClip(1e9, config.num_layers, config.num_heads, config.num_kv_heads)
    clipper.attach(model)
    model(tokens)
    return config, model, clipper, tokens, clipper.reduce("cpu")


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_qk_clip_brings_the_planted_heads_maximum_logit_to_tau_and_leaves_the_others(preset):
    """A planted large query weight makes block 0's head 1 exceed tau: after the clip the same batch gives that head
    (under grouped-query attention, its key/value group: the larger of heads 0 and 1) a maximum of exactly tau
    (rel 1e-4), block 0's other heads their own maxima, and every other weight stays as it was (the later blocks'
    maxima move with their inputs)."""
    config, model, clipper, tokens, before = _planted(preset)
    group = config.num_heads // config.num_kv_heads
    planted = list(range(group)) if group > 1 else [1]  # the heads sharing the planted one's key/value head
    others = before.clone()
    others[0, planted] = float("-inf")
    tau = float((before[0, planted].max() + others.max()) / 2)
    assert before[0, planted].max() > tau > others.max()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    clipper.tau = tau
    clipper.clip()
    clipper.reset()
    model(tokens)
    after = clipper.reduce("cpu")
    torch.testing.assert_close(after[0, planted].max(), torch.tensor(tau), rtol=1e-4, atol=0)
    kept = [h for h in range(config.num_heads) if h not in planted]
    torch.testing.assert_close(after[0, kept], before[0, kept], rtol=1e-6, atol=0)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, weights[n])}
    expected = {"blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias"} if config.fused_qkv else set()
    assert changed == (expected or {"blocks.0.attn.q.weight", "blocks.0.attn.k.weight"})


def test_qk_clip_refuses_q_k_norms_and_a_bad_tau_in_one_line():
    from mtnlg_lightning.parallel.qk_clip import QKClip

    with pytest.raises(MTNLGError, match="^model.qk_clip must be > 0, got 0.0$"):
        QKClip(0.0, 2, 4, 4)
    config = get_config("tiny-llama", family="qwen3")
    clipper = QKClip(1.0, config.num_layers, config.num_heads, config.num_kv_heads)
    with pytest.raises(MTNLGError, match="^model.qk_clip cannot clip a model with q/k norms"):
        clipper.attach(build_model(config))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("run", ["gpt_tp2_sp_qk", "gpt_pp2_qk", "gpt_dp2_qk", "gpt_cp2_qk"])
def test_muon_with_qk_clip_trains_like_one_process(run, muon_world2, muon_references):
    """MuonClip (tau 1.0, below the tiny GPT's largest logits: heads are clipped every step) in tp2 + SP (each TP
    rank's heads), pp2 (each stage's blocks; torch's shape inference on placeholder activations is not recorded),
    dp2 (the maxima over the replicas' samples) and cp2 (each rank's query chunks against the whole sequence's keys)
    reproduces one process, and logs the same per-layer maxima and clipped heads."""
    reference = muon_references["gpt_qk"]
    assert reference["qk_logs"]["qk_clipped_heads"] > 0
    assert_muon_trains_like(muon_world2[run], reference)
    logs = muon_world2[run]["qk_logs"]
    assert logs.keys() == reference["qk_logs"].keys()
    torch.testing.assert_close(logs, reference["qk_logs"], rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------------ the planner
def test_the_plan_counts_the_newton_schulz_flops_of_the_whole_logical_matrices():
    """The demo preset (hidden 256, MLP 1024, 4 blocks): per block Q, K, V, proj [256, 256] and fc1, fc2 [1024, 256]
    (m = 256, n = 1024), 5 iterations of 4 m^2 n + 2 m^3 each; the experts of a MoE directory one matrix each."""
    from mtnlg_lightning.planning.muon_plan import muon_layers

    square, wide = 5 * 6 * 256**3, 5 * (4 * 256 * 256 * 1024 + 2 * 256**3)
    layers = muon_layers(get_config("demo"))
    assert [layer.dense_flops for layer in layers] == [4 * square + 2 * wide] * 4
    assert sum(layer.dense_params for layer in layers) == 4 * (4 * 256 * 256 + 2 * 256 * 1024)
    moe = muon_layers(_models()["moe"])[0]
    assert moe.expert_params == 4 * 3 * 64 * 32 and moe.expert_flops == 4 * 3 * 5 * (4 * 32 * 32 * 64 + 2 * 32**3)


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_the_plan_holds_one_shared_momentum_buffer_instead_of_two_moments_and_times_the_step(zero_stage):
    """tp2 x pp2 x dp2 of the tiny GPT (ZeRO-3 with pp1): the model states shrink by AdamW's 8 bytes per hidden
    parameter of the stage's TP shard less Muon's 4 shared over the 2 replicas (ZeRO 1-3 partition AdamW's moments
    too: 8 / 2 less 4 / 2); the optimizer's seconds grow by the Newton-Schulz, TP-gather and DP seconds (the
    owners' broadcast at ZeRO-0, the all-to-alls of the partitions' pieces under ZeRO)."""
    from mtnlg_lightning.planning.muon_plan import MuonPlan, muon_layers
    from mtnlg_lightning.planning.planner import plan

    config = get_config("tiny")
    pp = 1 if zero_stage == 3 else 2
    settings = dict(config=config, tp=2, pp=pp, dp=2, gpus_per_node=8, gpu="h100-80g", global_batch=8)
    adamw, muon = (plan(**settings, zero_stage=zero_stage, muon=m) for m in (None, MuonPlan()))
    hidden = sum(layer.dense_params for layer in muon_layers(config)) / pp / 2  # the stage's blocks, its TP shard
    saved = (8 * hidden if zero_stage == 0 else 8 * hidden / 2) - 4 * hidden / 2
    assert (adamw.model_state_gb - muon.model_state_gb) * 1e9 == pytest.approx(saved, rel=1e-9)
    assert muon.muon["state_saved_gb"] * 1e9 == pytest.approx(saved, rel=1e-9)
    added = muon.breakdown["optimizer"] - adamw.breakdown["optimizer"]
    parts = ("newton_schulz_seconds", "tp_gather_seconds", "dp_seconds")
    assert added == pytest.approx(sum(muon.muon[k] for k in parts)) and all(muon.muon[k] > 0 for k in parts)
    zero0 = plan(**(settings | {"pp": 2}), zero_stage=0, muon=MuonPlan()).muon
    if zero_stage == 1:  # the pieces to the owners and back (2 + 4 bytes, half each) against a 4-byte broadcast
        assert muon.muon["dp_seconds"] == pytest.approx(zero0["dp_seconds"] * 6 / 4 / 2, rel=1e-9)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tp2_adamw_checkpoint_resumes_with_muon_in_dp2_when_the_optimizer_is_reset(muon_world2):
    """An AdamW run's tp2 checkpoint resumed with Muon in dp2 and `reset_optimizer`: the weights are the checkpoint's
    (step 4's loss is the AdamW run's, computed before the update), the steps go on from 3, and then Muon trains."""
    adamw, resumed = muon_world2["adamw_tp2_ckpt"], muon_world2["gpt_dp2_reset_from_adamw_tp2_ckpt"]
    assert len(resumed["losses"]) == 3
    torch.testing.assert_close(resumed["losses"][0], adamw["losses"][3], rtol=1e-6, atol=0)
    assert abs(resumed["losses"][2] - adamw["losses"][5]) > 1e-3
    assert sum(resumed["momentum_buffers"]) == 8  # the tiny GPT's matrices, shared out over the two replicas


@pytest.mark.slow
@pytest.mark.distributed
def test_a_dp2_muon_checkpoint_resumes_in_one_process(muon_world2, muon_references):
    """The dp2 run's step-3 checkpoint (each momentum buffer written by the replica that held it) resumed by
    Lightning's one-process strategy continues the uninterrupted run."""
    from dist_muon_runs import run_settings

    from testing.parallel_harness import assert_resumes_like, tiny_run, trained

    settings = run_settings("gpt_ckpt", muon_world2["_dir"], None) | {"checkpoint_dir": None, "capture_steps": (6,)}
    rec, _ = tiny_run(**settings, ckpt_path=muon_world2["_dir"] / "gpt_dp2_ckpt" / "step=3.ckpt")
    assert_resumes_like(trained(rec), muon_references["gpt"])
