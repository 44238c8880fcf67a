#!/usr/bin/env python
"""Activation memory per transformer layer per rank: no parallelism, TP and TP + sequence parallelism at tp 2 and 4,
measured beside Korthikanti et al. 2022's formulas.

Measured: the bytes autograd keeps for the backward pass (`torch.autograd.graph.saved_tensors_hooks`) while each
block runs forward, distinct storages counted once, parameters excluded: activation memory by definition, exact and
noise-free on CPU. One torchrun launch of 4 ranks builds the same model on every rank and shards it with
`apply_tensor_parallel` over the tp4 group and over two tp2 groups; max over ranks.

Formulas (bytes per layer, 2-byte activations and 1-byte dropout masks, t = TP degree, a = heads):
    none:     s*b*h*(34 + 5*a*s/h)
    TP:       s*b*h*(10 + 24/t + 5*a*s/(h*t))
    TP + SP:  s*b*h*(34/t + 5*a*s/(h*t))
The 5*a*s/h term (softmax scores, their dropout mask and output) is left out: scaled_dot_product_attention's
fused kernels keep no s x s matrix. This run keeps fp32 activations (x2) and no dropout masks (dropout 0), so the
absolute figures differ slightly by construction (TP: the two masks are part of the replicated 10; the attention
here saves its output besides Q, K, V); the ratios between layouts are the comparison.

    python benchmarks/bench_sequence_parallel_memory.py [--hidden 256 --heads 8 --seq 1024 --batch 2] [--json out]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model_shape import add_model_shape_args, shape_fields, shape_options
from results import benchmark_args, benchmark_parser, write_result

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent))  # the repository root: testing.*
from testing.activation_memory import saved_bytes_per_layer  # noqa: E402
from testing.forked_ranks import MODEL_RANK  # noqa: E402
from testing.local_ranks import worker_rows, write_rows  # noqa: E402

LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]  # (tensor_parallel, sequence_parallel)


def formula_bytes(s: int, b: int, h: int, t: int, sp: bool) -> float:
    """Korthikanti et al. per-layer activation bytes without the attention-score term (see the module doc)."""
    if t == 1:
        return s * b * h * 34
    return s * b * h * (34 / t if sp else 10 + 24 / t)


# ------------------------------------------------------------------ the ranks
def worker(args) -> None:
    import copy

    import torch
    import torch.distributed as dist

    from mtnlg_lightning.config import get_config
    from mtnlg_lightning.model import build_model
    from mtnlg_lightning.parallel.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = get_config("tiny", **shape_fields(args), max_position_embeddings=args.seq, vocab_size=4096)
    base = build_model(config)
    tokens = torch.randint(0, 4096, (args.batch, args.seq))
    tp2_groups = [dist.new_group(list(range(g, g + 2))) for g in range(0, world, 2)]
    rows = []
    for t, sp in LAYOUTS:
        model = copy.deepcopy(base)
        if t > 1:
            group = dist.group.WORLD if t == world else tp2_groups[rank // 2]
            apply_tensor_parallel(model, group, dist.get_rank(group), t, sequence_parallel=sp)
        per_layer = max(saved_bytes_per_layer(model, tokens))
        worst = [None] * world
        dist.all_gather_object(worst, per_layer)
        rows.append({"tp": t, "sp": sp, "measured_bytes": max(worst)})
    write_rows(args.worker, rows)


# ------------------------------------------------------------------ the parent
def main() -> int:
    parser = benchmark_parser(__doc__)
    add_model_shape_args(parser, layers=2, hidden=256, heads=8, seq=1024)
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = benchmark_args(parser)
    if args.worker:
        worker(args)
        return 0

    rows = worker_rows(4, __file__, *shape_options(args), "--batch", args.batch, preload=MODEL_RANK)

    s, b, h = args.seq, args.batch, args.hidden
    none = next(r for r in rows if r["tp"] == 1)["measured_bytes"]
    print(
        f"activation memory per layer per rank (h {h}, heads {args.heads}, seq {s}, micro-batch {b}; fp32, "
        f"max over ranks)\n{'layout':<10} {'measured MB':>11} {'formula MB (fp32)':>17} {'measured/none':>13} "
        f"{'formula/none':>12}"
    )
    for r in rows:
        name = "none" if r["tp"] == 1 else f"tp{r['tp']}" + ("+sp" if r["sp"] else "")
        formula = 2 * formula_bytes(s, b, h, r["tp"], r["sp"])  # fp32: twice the formula's 2-byte activations
        r.update(
            layout=name,
            formula_fp32_bytes=formula,
            measured_vs_none=r["measured_bytes"] / none,
            formula_vs_none=formula / (2 * formula_bytes(s, b, h, 1, False)),
        )
        print(
            f"{name:<10} {r['measured_bytes'] / 1e6:>11.2f} {formula / 1e6:>17.2f} {r['measured_vs_none']:>13.3f} "
            f"{r['formula_vs_none']:>12.3f}"
        )
    result = {"hidden": h, "heads": args.heads, "seq": s, "batch": b, "layers": args.layers, "rows": rows}
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
