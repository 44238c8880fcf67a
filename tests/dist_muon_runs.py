"""Muon runs (`--model.optimizer muon`) in the layouts named on the command line (one torchrun launch):

    torchrun --standalone --nproc-per-node 2 tests/dist_muon_runs.py OUT_DIR MOE_DIR gpt_tp2_sp gpt_pp2 moe_ep2 ...

A run is FAMILY_LAYOUT: FAMILY `gpt` (the tiny preset: a fused QKV), `adamw` (the same with AdamW) or `moe` (the
Qwen 3-MoE directory MOE_DIR, its settings and layouts as in dist_moe_runs.py: epN, tpM, ppM, _sp); LAYOUT for gpt
spelled as in dist_family_runs.py (tp2, pp2, dp2, tp2_pp2_dp2, _sp, _zeroN for DeepSpeed ZeRO stage N). Suffixes:
_alone orthogonalises each TP shard as if it were the whole matrix (what Megatron's `blockwise` mode does; the test
shows it is not one process's Muon); _bf16ns runs the Newton-Schulz iteration in torch's bf16 (the others in fp32,
smooth in the gradient); _bf16 trains in bf16-mixed precision (_fp32acc: accumulating fp32 gradients); _subgroups
cuts ZeRO-3's partitions into sub-groups of 20k parameters; _qk clips
the attention heads' logits at QK_CLIP (`model.qk_clip`); _reset resumes with `model.reset_optimizer`; _ckpt
trains 6 steps saving at 3 and 6; _from_RUN resumes RUN's step-3 checkpoint. Rank 0 writes OUT_DIR/NAME.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: testing.*
import dist_family_runs  # noqa: E402
import dist_moe_runs  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mtnlg_lightning.parallel import muon  # noqa: E402
from mtnlg_lightning.parallel.zero import base_optimizer  # noqa: E402
from mtnlg_lightning.train import optimizer_recipe  # noqa: E402
from testing.parallel_harness import run_named_with_source, run_script, tiny_run, trained  # noqa: E402

# Newton-Schulz in fp32: bf16's rounding would turn the layouts' fp32 noise into differences above the tests' bounds.
MUON = {"optimizer": "muon", "muon": {"lr": 0.01, "adjust_lr": "original", "ns_dtype": "float32"}}
QK_CLIP = 1.0  # below the tiny GPT's largest logits (~1.1-1.4): some heads are clipped every step


def run_settings(name: str, out: Path, source: str | None) -> dict:
    """`tiny_run`'s arguments of a run name less the strategy (a one-process reference takes the same)."""
    family, _, rest = name.partition("_")
    layout, _, origin = rest.partition("_from_")
    parts = layout.split("_")
    muon = MUON if "bf16ns" not in parts else {**MUON, "muon": {**MUON["muon"], "ns_dtype": "bfloat16"}}
    muon = (
        muon | ({"qk_clip": QK_CLIP} if "qk" in parts else {}) | ({"reset_optimizer": True} if "reset" in parts else {})
    )
    if family == "adamw":  # the tiny GPT with AdamW
        muon = {}
    settings = dist_moe_runs.run_settings(layout, out) if family == "moe" else {}
    settings = {key: value for key, value in settings.items() if key not in ("max_steps", "capture_steps")}
    if family == "gpt" and "bf16" in parts:
        settings["precision"] = "bf16-mixed"
    settings |= {"module_settings": muon, "init_from": source if family == "moe" else None}
    if "ckpt" in parts:
        settings |= {"max_steps": 6, "capture_steps": (5, 6), "checkpoint_dir": out / f"{family}_{layout}"}
    if origin:
        settings |= {"max_steps": 6, "capture_steps": (6,), "ckpt_path": out / origin / "step=3.ckpt"}
    return settings


def train(name: str, out: Path, source: str) -> dict:
    family, _, rest = name.partition("_")
    layout = rest.partition("_from_")[0]
    suffixes = ("alone", "ckpt", "bf16ns", "bf16", "fp32acc", "subgroups", "qk", "reset")
    parts = [p for p in layout.split("_") if p not in suffixes]
    if family == "moe":
        strategy, micro_batch = dist_moe_runs.strategy_of("_".join(parts)), 2
    else:
        strategy, micro_batch = dist_family_runs.strategy_of("_".join(parts))
    if "fp32acc" in layout.split("_"):  # bf16 ZeRO-1 then runs DeepSpeed's BF16_Optimizer
        strategy.extra_deepspeed_config = {"data_types": {"grad_accum_dtype": "fp32"}}
    if "subgroups" in layout.split("_"):  # ZeRO-3 steps its partitions in sub-groups of about 20k parameters
        strategy.extra_deepspeed_config["zero_optimization"]["sub_group_size"] = 20_000
    settings = run_settings(name, out, source)
    settings.setdefault("micro_batch_size", micro_batch)
    world = int(os.environ["WORLD_SIZE"])
    real = optimizer_recipe.matrix_layout
    if "alone" in layout.split("_"):  # every TP shard orthogonalised as a matrix of its own
        optimizer_recipe.matrix_layout = lambda param, qkv, tp_size: muon.MatrixLayout(qkv)
    try:
        rec, trainer = tiny_run(strategy, devices=world, **settings)
    finally:
        optimizer_recipe.matrix_layout = real
    optimizer = trainer.optimizers[0]
    inner = base_optimizer(optimizer)
    held = [None] * world  # how many momentum buffers each rank holds, and their elements
    dist.all_gather_object(held, sum(muon.MOMENTUM_BUFFER in s for s in inner.state.values()))
    momentum = [None] * world
    dist.all_gather_object(
        momentum, sum(s[muon.MOMENTUM_BUFFER].numel() for s in inner.state.values() if muon.MOMENTUM_BUFFER in s)
    )
    owned = [None] * world  # under ZeRO: how many matrices each rank orthogonalises whole
    dist.all_gather_object(owned, sum(len(share.owned()) for share in getattr(inner, "partitions", {}).values()))
    tp_rank = strategy.groups.tensor_parallel_rank
    orthogonalised = [None] * world  # how many TP-split matrices each rank orthogonalises
    dist.all_gather_object(orthogonalised, sum(o == tp_rank for o in getattr(optimizer, "tp_owners", {}).values()))
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("qk_")}
    return trained(rec) | {
        "momentum_buffers": held,
        "optimizer": type(optimizer).__name__,  # DeepSpeed's wrapper under ZeRO
        "momentum_elements": momentum,
        "zero_orthogonalised": owned,
        "qk_logs": logged,
        "tp_orthogonalised": orthogonalised,
    }


if __name__ == "__main__":
    run_script(lambda: run_named_with_source("dist_muon_runs", train))
