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

--gated-deltanet: one Gated DeltaNet layer instead (Qwen3-Next's: head dims 128, kernel 4; --heads value heads, half
as many key heads) on one sequence of --seq, alone, in cp2 gathering the whole sequence (`ContextGather`) and in
cp2 passing the state (`ContextStatePassing`), side by side: the same activations and peak (of the first step), and
the seconds of a forward + backward, wall and the process's CPU (the fastest of --repeat after it, max over ranks;
the ranks share the machine's cores, so where they are busy the CPU seconds say more).

    python benchmarks/bench_context_parallel_memory.py [--seq 8192 --layers 4 --hidden 256 --heads 4] [--json out]
    python benchmarks/bench_context_parallel_memory.py --gated-deltanet --seq 4096 --hidden 1024 --heads 8
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
LINEAR_RUNS = (("alone", 1), ("gather", 2), ("states", 2))  # a Gated DeltaNet layer's context parallelism, ranks


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


def start_rank() -> tuple[int, int]:
    """This launch's (rank, CP degree: the world), its random seed set alike on every rank."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    return dist.get_rank(), dist.get_world_size()


def first_step_memory(step) -> tuple[int, int]:
    """(the bytes `step()` saves for backward, as it returns them; the peak resident memory over the level before)
    of a step run once on every rank at the same time (a process's allocator keeps what it freed: the first step's)."""
    import torch
    import torch.distributed as dist

    from mtnlg_lightning.train.peak_memory import StepPeakMemory

    peak = StepPeakMemory(torch.device("cpu"))
    dist.barrier()
    peak.reset()
    before = peak.read_bytes()
    activations = step()
    return activations, peak.read_bytes() - before


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from mtnlg_lightning.config import get_config
    from mtnlg_lightning.loss import cross_entropy
    from mtnlg_lightning.model import build_model
    from mtnlg_lightning.parallel.context_parallel import ContextParallelLoss, Ring, apply_context_parallel

    rank, cp = start_rank()
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

    def step() -> int:
        activations, logits = saved_bytes(model, tokens[:, :-1])
        loss_fn(logits, tokens[:, 1:]).backward()
        return activations

    activations, used = first_step_memory(step)
    found = [None] * cp
    dist.all_gather_object(found, (activations, used))
    write_rows(
        args.worker, {"cp": cp, "activation_bytes": max(a for a, _ in found), "peak_bytes": max(u for _, u in found)}
    )


def gated_deltanet_worker(args) -> None:
    import time

    import torch
    import torch.distributed as dist

    from mtnlg_lightning.config import get_config
    from mtnlg_lightning.linear_attention import GatedDeltaNet
    from mtnlg_lightning.parallel.context_parallel import LINEAR_CONTEXT, split_sequence

    rank, cp = start_rank()
    config = get_config(
        "qwen3-next-80b-a3b",
        hidden_size=args.hidden,
        linear_num_key_heads=args.heads // 2,
        linear_num_value_heads=args.heads,
    )
    layer = GatedDeltaNet(config)
    x, grad = torch.randn(1, args.seq, args.hidden), torch.randn(1, args.seq, args.hidden)
    if cp > 1:
        layer.context = LINEAR_CONTEXT[args.linear](dist.group.WORLD, rank, cp)
        x, grad = split_sequence(x, rank, cp), split_sequence(grad, rank, cp)
    x.requires_grad_()

    def step() -> int:
        layer.zero_grad(set_to_none=True)
        activations, y = saved_bytes(layer, x)
        (y * grad).sum().backward()
        return activations

    activations, used = first_step_memory(step)
    seconds, cpu_seconds = [], []  # wall and this process's CPU: the ranks share the machine's cores
    for _ in range(args.repeat):
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    found = [None] * cp
    dist.all_gather_object(found, (activations, used, min(seconds), min(cpu_seconds)))
    row = {"run": args.linear, "cp": cp, "activation_bytes": max(f[0] for f in found)}
    row.update(peak_bytes=max(f[1] for f in found), seconds=max(f[2] for f in found))
    row.update(cpu_seconds=max(f[3] for f in found))
    write_rows(args.worker, row)


def memory_columns(rows: list[dict], first: str) -> list:
    """The table's columns of activations and peak, each also as a share of the first row's (`first` names it; the
    rows get the shares as activation_vs_<first>, peak_vs_<first>)."""
    for r in rows:
        r[f"activation_vs_{first}"] = r["activation_bytes"] / rows[0]["activation_bytes"]
        r[f"peak_vs_{first}"] = r["peak_bytes"] / rows[0]["peak_bytes"]
    return [
        ("activations MB", lambda r: f"{r['activation_bytes'] / 1e6:.1f}"),
        (f"vs {first}", lambda r: f"{r[f'activation_vs_{first}']:.3f}"),
        ("peak MB", lambda r: f"{r['peak_bytes'] / 1e6:.1f}"),
        (f"vs {first}", lambda r: f"{r[f'peak_vs_{first}']:.3f}"),
    ]


def print_table(title: str, rows: list[dict], columns: list) -> None:
    """`title`, then one line per row: `columns` (header, the row's cell as text), right-aligned."""
    widths = [max(len(header), 7) for header, _ in columns]
    print(title)
    print(" ".join(f"{header:>{w}}" for (header, _), w in zip(columns, widths, strict=True)))
    for r in rows:
        print(" ".join(f"{cell(r):>{w}}" for (_, cell), w in zip(columns, widths, strict=True)))


def gated_deltanet_main(args) -> int:
    options = ["--gated-deltanet", "--repeat", args.repeat, *shape_options(args)]
    rows = [
        worker_rows(cp, __file__, *options, "--linear", run, preload=MODEL_RANK, what=f"{run} ")
        for run, cp in LINEAR_RUNS
    ]
    dk = dv = 128  # Qwen3-Next's head dims
    # what each rank sends per layer passing the state: its 2 chunks' (C | M) and kernel - 1 = 3 convolution inputs
    exchanged = 2 * args.heads * dk * (dv + dk) * 4 + 2 * 3 * (2 * (args.heads // 2) * dk + args.heads * dv) * 4
    columns = [("run", lambda r: r["run"]), ("cp", lambda r: str(r["cp"])), *memory_columns(rows, "alone")]
    columns += [("seconds", lambda r: f"{r['seconds']:.3f}"), ("CPU s", lambda r: f"{r['cpu_seconds']:.2f}")]
    title = (
        f"one Gated DeltaNet layer (hidden {args.hidden}, {args.heads // 2} key / {args.heads} value heads of 128), "
        f"one sequence of {args.seq} tokens (fp32, forward + backward, max over ranks)"
    )
    print_table(title, rows, columns)
    gathered = args.seq // 2 * args.hidden * 4  # gathering: its 2c = S / 2 hidden states (fp32)
    print(f"each rank sends per layer {exchanged / 1e6:.2f} MB passing the state, {gathered / 1e6:.2f} MB gathering")
    result = {"seq": args.seq, "hidden": args.hidden, "heads": args.heads, "rows": rows}
    result.update(sent_bytes_passing_the_state=exchanged, sent_bytes_gathering=gathered)
    write_result(args.json, result)
    return 0


def main() -> int:
    parser = benchmark_parser(__doc__)
    add_model_shape_args(parser, layers=4, hidden=256, heads=4, seq=8192)
    parser.add_argument("--gated-deltanet", action="store_true", help="one Gated DeltaNet layer (see above)")
    parser.add_argument("--repeat", type=int, default=3, help="--gated-deltanet's timed steps (default 3)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--linear", choices=("alone", "gather", "states"), help=argparse.SUPPRESS)
    args = benchmark_args(parser)
    if args.worker:
        gated_deltanet_worker(args) if args.gated_deltanet else worker(args)
        return 0
    if args.gated_deltanet:
        return gated_deltanet_main(args)
    rows = [worker_rows(cp, __file__, *shape_options(args), preload=MODEL_RANK) for cp in DEGREES]
    title = (
        f"one sequence of {args.seq} tokens, {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
        f"(fp32, forward + backward, max over ranks)"
    )
    print_table(title, rows, [("cp", lambda r: str(r["cp"])), *memory_columns(rows, "cp1")])
    write_result(args.json, {"seq": args.seq, "layers": args.layers, "hidden": args.hidden, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
