#!/usr/bin/env python
"""Pipeline schedule efficiency: measured idle fraction per stage vs the theoretical bubble (PP-1)/(MB+PP-1).

Each stage runs the real schedules of `torch.distributed.pipelining` (as the strategy does) over gloo, one rank per
stage (one launch of PP local ranks, `testing/local_ranks.py`). Stage compute is a fixed-duration wait (forward t,
backward 2t, as a transformer layer) so that the measurement isolates the schedule: with 2 CPU cores, real matmuls
in 4 processes would measure core sharing instead of pipeline bubbles. Idle fraction of a stage = 1 - busy / step
time, over several steps after a warm-up.

    python benchmarks/bench_pipeline.py [--pp 2 4] [--microbatches 4 8 16] [--forward-ms 4] [--steps 3]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from results import benchmark_args, benchmark_parser, write_result
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the repository root: testing.*

from mtnlg_lightning.parallel.pipeline import schedule_class, stages_held_by_rank  # noqa: E402
from testing.forked_ranks import MODEL_RANK  # noqa: E402
from testing.local_ranks import worker_rows, write_rows  # noqa: E402

HIDDEN = 16


class TimedWait(torch.autograd.Function):
    """Identity whose forward takes `fwd` seconds and backward `2 * fwd`; adds the time to a busy counter."""

    @staticmethod
    def forward(ctx, x, fwd, busy):
        ctx.fwd, ctx.busy = fwd, busy
        start = time.perf_counter()
        time.sleep(fwd)
        busy[0] += time.perf_counter() - start
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        time.sleep(2 * ctx.fwd)
        ctx.busy[0] += time.perf_counter() - start
        return grad.clone(), None, None


class SimulatedStage(nn.Module):
    def __init__(self, seconds: float, busy: list):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.seconds, self.busy = seconds, busy

    def forward(self, x):
        return TimedWait.apply(self.proj(x), self.seconds, self.busy)


def worker(args) -> None:
    """One stage of a PP-rank launch: every schedule and micro-batch count; rank 0 writes the rows."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    from torch.distributed.pipelining import PipelineStage

    results = []
    for schedule in args.schedules:
        per_rank = 2 if schedule == "interleaved_1f1b" else 1
        num_stages = world * per_rank
        for m in args.microbatches:
            if schedule == "interleaved_1f1b" and m % world:
                continue
            busy = [0.0]
            # A rank does the same total work whatever the schedule: its layers split over its virtual stages.
            seconds = args.forward_ms / 1000 / per_rank
            stages = [
                PipelineStage(SimulatedStage(seconds, busy), s, num_stages, torch.device("cpu"))
                for s in stages_held_by_rank(schedule, world, per_rank)[rank]
            ]
            loss_fn = lambda out, target: out.float().pow(2).mean()  # noqa: E731
            sched = schedule_class(schedule)(
                stages if per_rank > 1 else stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=False
            )
            x = torch.randn(m, 4, HIDDEN)
            idle = []
            for step in range(args.steps + 1):
                busy[0] = 0.0
                dist.barrier()
                start = time.perf_counter()
                is_first, is_last = rank == 0, rank == world - 1  # looped placement: stage 0 and the last
                sched.step(*((x,) if is_first else ()), **({"target": x} if is_last else {}))
                dist.barrier()
                wall = time.perf_counter() - start
                if step:  # the first step is a warm-up
                    idle.append(1 - busy[0] / wall)
            gathered = [None] * world
            dist.all_gather_object(gathered, statistics.median(idle))
            if rank == 0:
                results.append(
                    {
                        "schedule": schedule,
                        "pp": world,
                        "microbatches": m,
                        "idle_per_stage": gathered,
                        "theory_1f1b": (world - 1) / (m + world - 1),
                        "theory_interleaved": (world - 1) / (per_rank * m + world - 1),
                    }
                )
    write_rows(args.worker, results)


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (default 2 4)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16], help="micro-batches per step")
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=["1f1b", "interleaved_1f1b", "gpipe"],
        help="schedules to compare (default 1f1b interleaved_1f1b gpipe)",
    )
    parser.add_argument(
        "--forward-ms",
        type=float,
        default=20.0,
        help="forward time of one stage per micro-batch; per-op overhead (gloo send/recv, schedule "
        "bookkeeping, ~1-2 ms here) adds idle time that theory does not count, so keep it large",
    )
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration (after 1 warm-up)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a rank of the launch: rank 0 writes its rows here
    args = benchmark_args(parser)
    if args.worker:
        worker(args)
        return 0
    options = ["--microbatches", *args.microbatches, "--schedules", *args.schedules]
    options += ["--forward-ms", args.forward_ms, "--steps", args.steps]
    rows = [row for pp in args.pp for row in worker_rows(pp, __file__, *options, what=f"pp={pp} ", preload=MODEL_RANK)]
    print(f"{'schedule':<17} {'pp':>3} {'mb':>3} {'idle/stage (measured)':<30} {'mean':>6} {'theory':>7}")
    for r in rows:
        theory = r["theory_interleaved"] if r["schedule"] == "interleaved_1f1b" else r["theory_1f1b"]
        stages = " ".join(f"{x:.2f}" for x in r["idle_per_stage"])
        print(
            f"{r['schedule']:<17} {r['pp']:>3} {r['microbatches']:>3} {stages:<30} "
            f"{statistics.mean(r['idle_per_stage']):>6.3f} {theory:>7.3f}"
        )
    by_key = {(r["schedule"], r["pp"], r["microbatches"]): statistics.mean(r["idle_per_stage"]) for r in rows}
    for pp in args.pp:
        for m in args.microbatches:
            a, b = by_key.get(("1f1b", pp, m)), by_key.get(("interleaved_1f1b", pp, m))
            if a is not None and b is not None:
                print(f"pp {pp} mb {m:>2}: interleaved idle {b:.3f} vs 1f1b {a:.3f} (ratio {b / a:.2f})")
    write_result(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
