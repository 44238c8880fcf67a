#!/usr/bin/env python
"""Memory per rank of one long sequence under context parallelism: CP 1, 2 and 4 side by side, one launch.

A small Llama-style model (default 4 layers, hidden 256, 4 query heads sharing 2 key/value heads, SwiGLU, RoPE)
runs forward and backward on one sequence of --seq tokens (default 8192): alone (CP 1), in a ring of 2 ranks (CP 2)
and of 4 (CP 4), one fresh launch each (a process's allocator keeps what it freed, so one process per degree):
- activations: the bytes autograd keeps for the backward pass over the whole forward
  (`torch.autograd.graph.saved_tensors_hooks`, distinct storages, parameters excluded): exact, noise-free;
- peak: the process's peak resident memory during forward + backward over its level before (Linux VmHWM, reset
  before each run), which also holds the transient tensors (the ring's key/value chunks in flight, the logits).
Max over ranks. Activations should fall close to 1 / CP: each rank embeds, projects and scores S / CP tokens.

    python benchmarks/bench_context_parallel_memory.py [--seq 8192 --layers 4 --hidden 256 --heads 4] [--json out]
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
from testing.forked_ranks import MODEL_RANK  # noqa: E402
from testing.local_ranks import worker_rows, write_rows  # noqa: E402

DEGREES = (1, 2, 4)


def saved_bytes(model, tokens) -> tuple[int, object]:
    """(bytes saved for backward by the forward, the output), parameters excluded, each storage once."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens)
    return sum(seen.values()), out


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from mtnlg_lightning.config import get_config
    from mtnlg_lightning.loss import cross_entropy
    from mtnlg_lightning.model import build_model
    from mtnlg_lightning.parallel.context_parallel import ContextParallelLoss, Ring, apply_context_parallel
    from mtnlg_lightning.train.peak_memory import StepPeakMemory

    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = get_config(
        "tiny-llama",
        **shape_fields(args),
        num_kv_heads=max(1, args.heads // 2),
        ffn_hidden_size=int(args.hidden * 8 / 3) // 16 * 16,
        max_position_embeddings=args.seq,
        vocab_size=4096,
    )
    model = build_model(config)
    tokens = torch.randint(0, 4096, (1, args.seq + 1))
    loss_fn = cross_entropy
    if cp > 1:
        ring = Ring(dist.group.WORLD, list(range(cp)), rank)
        apply_context_parallel(model, ring)
        loss_fn = ContextParallelLoss(cross_entropy, rank, cp)
    peak = StepPeakMemory(torch.device("cpu"))
    dist.barrier()
    peak.reset()
    before = peak.read_bytes()
    activations, logits = saved_bytes(model, tokens[:, :-1])
    loss_fn(logits, tokens[:, 1:]).backward()
    used = peak.read_bytes() - before
    found = [None] * cp
    dist.all_gather_object(found, (activations, used))
    write_rows(
        args.worker, {"cp": cp, "activation_bytes": max(a for a, _ in found), "peak_bytes": max(u for _, u in found)}
    )


def main() -> int:
    parser = benchmark_parser(__doc__)
    add_model_shape_args(parser, layers=4, hidden=256, heads=4, seq=8192)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = benchmark_args(parser)
    if args.worker:
        worker(args)
        return 0
    rows = [worker_rows(cp, __file__, *shape_options(args), preload=MODEL_RANK) for cp in DEGREES]
    alone = rows[0]
    print(
        f"one sequence of {args.seq} tokens, {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
        f"(fp32, forward + backward, max over ranks)\n"
        f"{'cp':>3} {'activations MB':>15} {'vs cp1':>7} {'peak MB':>9} {'vs cp1':>7}"
    )
    for r in rows:
        r["activation_vs_cp1"] = r["activation_bytes"] / alone["activation_bytes"]
        r["peak_vs_cp1"] = r["peak_bytes"] / alone["peak_bytes"]
        print(
            f"{r['cp']:>3} {r['activation_bytes'] / 1e6:>15.1f} {r['activation_vs_cp1']:>7.3f} "
            f"{r['peak_bytes'] / 1e6:>9.1f} {r['peak_vs_cp1']:>7.3f}"
        )
    write_result(args.json, {"seq": args.seq, "layers": args.layers, "hidden": args.hidden, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
