"""Expert-parallel runs from a Hugging Face mixture-of-experts directory, in the layouts named on the command line
(one torchrun launch):

    torchrun --standalone --nproc-per-node 4 tests/dist_moe_runs.py OUT_DIR MOE_DIR ep2_ckpt ep4 ep2_accum ep4_from_ep2

A run is epN: data parallelism over the whole world with each MoE layer's experts split over N of the DP ranks
(plain DP, zero_stage 0), micro-batches of 2 rows (the global batch of 8 over 4 ranks: one micro-batch each).
_tpM: beside M-way tensor parallelism (the experts whole on each TP rank), _sp: with sequence parallelism, _cpM:
M-way context parallelism (each sequence split over M ranks, the experts' copies over DP x CP), _ppM: M pipeline
stages (1F1B; the router statistics travel with the activations), _v2: two virtual stages per rank (interleaved
1F1B), _zK: ZeRO stage K (DeepSpeed; the experts' state partitioned over the ranks holding them). A run name
may start with ppM or tpM (no EP).
A name starting with sig_ routes by sigmoid (DeepSeek-V3's router: a bias chooses, moved 0.01 toward balance
after each step; with norm_topk_prob) instead of Qwen 3-MoE's softmax. A name starting with mla_ trains the
DeepSeek-V3 directory, glm_ the GLM-4.5 one (MOE_DIR may be MOE_DIR:MLA_DIR:GLM_DIR): multi-head latent attention
or partial rotary with q/k/v biases and q/k norms, sigmoid routing in groups, shared experts, the first block dense
(the bias moved 0.01 per step as sig_'s). A name starting with mtp_ trains a DeepSeek-V3 directory holding one
multi-token prediction layer (MOE_DIR:MLA_DIR:GLM_DIR:MTP_DIR) with mtp_layers 1: the main and MTP losses.
Suffixes: _bf16 runs in bf16-mixed precision; _accum takes micro-batches of 1 (two accumulated per step); _full
recomputes every block in the backward (activation checkpointing: the routing and the all-to-alls run again); _ckpt
trains 6 steps saving at 3 and 6;
_from_RUN resumes that run's step-3 checkpoint. Rank 0 writes OUT_DIR/NAME.pt (losses, grad norms, parameters).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: testing.*
from mtnlg_lightning.callbacks import ActivationCheckpointing  # noqa: E402
from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy  # noqa: E402
from testing.parallel_harness import run_each, run_script, tiny_run, trained  # noqa: E402

# The router's auxiliary (load-balancing) and z losses both on, dropless routing (no capacity factor).
ROUTER_LOSSES = {"router_aux_loss_coef": 0.02, "router_z_loss_coef": 0.001}
# A step large enough that the bias changes which experts some tokens go to within the 6 steps of a run. No family
# routes by sigmoid: the model becomes a custom block (family null).
SIGMOID_ROUTER = {"family": None, "router": "sigmoid", "router_bias_update_rate": 0.01, "norm_topk_prob": True}


def run_settings(name: str, out: Path) -> dict:
    """`tiny_run`'s arguments for a run name (the one-process references take the same, less the strategy)."""
    layout, _, source = name.partition("_from_")
    parts = layout.split("_")
    overrides = ROUTER_LOSSES | (SIGMOID_ROUTER if "sig" in parts else {})
    if "mla" in parts or "glm" in parts or "mtp" in parts:  # the family routes by sigmoid already
        overrides |= {"router_bias_update_rate": SIGMOID_ROUTER["router_bias_update_rate"]}
    if "mtp" in parts:
        overrides |= {"mtp_layers": 1}
    settings = {"micro_batch_size": 1 if "accum" in parts else 2, "model_overrides": overrides}
    if "bf16" in parts:
        settings["precision"] = "bf16-mixed"
    if "full" in parts:
        settings["callbacks"] = [ActivationCheckpointing(mode="full")]
    if "ckpt" in parts:
        settings |= {"max_steps": 6, "capture_steps": (5, 6), "checkpoint_dir": out / layout}
    if source:
        settings |= {"max_steps": 6, "capture_steps": (6,), "ckpt_path": out / source / "step=3.ckpt"}
    return settings


def strategy_of(layout: str) -> MegatronDeepSpeedStrategy:
    """epN, tpM, cpM, ppM (any of them; 1 where absent) and sp: the experts over N DP ranks beside M-way tensor,
    context or pipeline parallelism (1F1B)."""
    parts = layout.split("_")
    axes = ("ep", "tp", "cp", "pp")
    size = {axis: next((int(p.removeprefix(axis)) for p in parts if p.startswith(axis)), 1) for axis in axes}
    return MegatronDeepSpeedStrategy(
        expert_parallel=size["ep"],
        tensor_parallel=size["tp"],
        context_parallel=size["cp"],
        pipeline_parallel=size["pp"],
        **({"pipeline_schedule": "interleaved_1f1b", "virtual_pipeline_stages": 2} if "v2" in parts else {}),
        sequence_parallel="sp" in parts,
        zero_stage=next((int(p.removeprefix("z")) for p in parts if p in ("z1", "z2", "z3")), 0),
        print_layout=False,
    )


def train(name: str, out: Path, source: str) -> dict:
    strategy = strategy_of(name.partition("_from_")[0])
    world = int(os.environ["WORLD_SIZE"])
    rec, _ = tiny_run(strategy, devices=world, init_from=source, **run_settings(name, out))
    return trained(rec)


def main() -> None:
    out, sources = Path(sys.argv[1]), sys.argv[2].split(os.pathsep)
    out.mkdir(parents=True, exist_ok=True)

    def source_of(name: str) -> str:
        return sources[{"mla": 1, "glm": 2, "mtp": 3}.get(name.partition("_")[0], 0)]

    run_each("dist_moe_runs", sys.argv[3:], out, lambda name: train(name, out, source_of(name)))


if __name__ == "__main__":
    run_script(main)
