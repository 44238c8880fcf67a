#!/usr/bin/env python
"""One optimizer step of Muon (`--model.optimizer muon`: Muon for the hidden matrices, AdamW for the rest) against
the AdamW every run uses, on the same model and the same gradients, in one process: the step's seconds and the
optimizer state's bytes.

    python benchmarks/bench_muon.py [--preset demo --rounds 5 --steps 10 --ns-dtype bfloat16]

Both optimizers are built as `MTNLGModule.configure_optimizers` builds them (`train/optimizer_recipe.py`) over two
copies of the model holding the same random gradients; the variants alternate for --rounds rounds of --steps timed
steps each (the first step, which creates the state, untimed); reported: the median seconds per step, the state's
bytes (Muon: one fp32 buffer per hidden matrix; AdamW: two moments per parameter) and the Newton-Schulz FLOPs of a
step.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from results import add_rounds_arg, benchmark_args, benchmark_parser, write_result  # noqa: E402

from mtnlg_lightning.config import get_config  # noqa: E402
from mtnlg_lightning.model import build_model  # noqa: E402
from mtnlg_lightning.parallel.muon import MuonSettings, logical_matrices  # noqa: E402
from mtnlg_lightning.train.optimizer_recipe import build_adamw, build_muon, muon_split  # noqa: E402

RECIPE = {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "fused": None}


def ns_flops(model, config, steps: int) -> float:
    """Newton-Schulz FLOPs of one step: per [m, n] matrix (m <= n) and iteration, X X^T (2 m^2 n), A A (2 m^3) and
    B X (2 m^2 n)."""
    _, _, hidden, stacked = muon_split(model)
    qkv = {id(p) for n, p in model.named_parameters() if n.endswith("qkv.weight")}
    total = 0.0
    for param in hidden + stacked:
        for matrix in logical_matrices(param.detach(), config.head_dim if id(param) in qkv else None):
            m, n = sorted((matrix.numel() // matrix.shape[-1], matrix.shape[-1]))
            total += steps * (4 * m * m * n + 2 * m**3)
    return total


def state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)


def main(argv=None) -> dict:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ns-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    add_rounds_arg(parser, 5)
    args = benchmark_args(parser, argv)
    config = get_config(args.preset)
    torch.manual_seed(0)
    models = {"adamw": build_model(config), "muon": build_model(config)}
    models["muon"].load_state_dict(models["adamw"].state_dict())
    for model in models.values():
        torch.manual_seed(1)
        for param in model.parameters():
            param.grad = torch.randn_like(param) * 1e-2
    muon = MuonSettings(ns_dtype=args.ns_dtype)
    head_dim = config.head_dim if config.fused_qkv else None
    optimizers = {
        "adamw": build_adamw(models["adamw"], **RECIPE),
        "muon": build_muon(models["muon"], muon, **RECIPE, fused_qkv_head_dim=head_dim),
    }
    for optimizer in optimizers.values():
        optimizer.step()  # creates the state
    seconds = {name: [] for name in optimizers}
    for _ in range(args.rounds):
        for name, optimizer in optimizers.items():
            started = time.perf_counter()
            for _ in range(args.steps):
                optimizer.step()
            seconds[name].append((time.perf_counter() - started) / args.steps)
    params = sum(p.numel() for p in models["adamw"].parameters())
    result = {
        "preset": args.preset,
        "params": params,
        "ns_dtype": args.ns_dtype,
        "step_seconds": {name: statistics.median(s) for name, s in seconds.items()},
        "state_bytes": {name: state_bytes(o) for name, o in optimizers.items()},
        "ns_flops_per_step": ns_flops(models["muon"], config, muon.ns_steps),
    }
    ratio = result["step_seconds"]["muon"] / result["step_seconds"]["adamw"]
    print(
        f"{args.preset} ({params / 1e6:.1f}M params), {args.ns_dtype} Newton-Schulz: optimizer step "
        f"{result['step_seconds']['muon'] * 1e3:.1f} ms (Muon) vs {result['step_seconds']['adamw'] * 1e3:.1f} ms "
        f"(AdamW), x{ratio:.2f}; state {result['state_bytes']['muon'] / 1e6:.1f} MB vs "
        f"{result['state_bytes']['adamw'] / 1e6:.1f} MB; Newton-Schulz {result['ns_flops_per_step'] / 1e9:.2f} GFLOP"
    )
    write_result(args.json, result)
    return result


if __name__ == "__main__":
    main()
