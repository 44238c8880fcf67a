#!/usr/bin/env python
"""Per-rank model-state memory under ZeRO 0/1/2/3 at dp=2 and dp=4: measured on the live objects vs the planner.

Each data-parallel size is one torchrun launch training the model 2 steps per ZeRO stage through
`MegatronDeepSpeedStrategy`; `StateBytesProbe` reads params, grads, fp32 master and Adam moments from the live
model/optimizer (storages counted once). Beside it: the planner's arithmetic (`planner.model_state_bytes`) with
`precision="fp32"`, because these CPU runs train in fp32 (weights 4 + grads 4 + Adam moments 8 = 16 bytes/param,
plus DeepSpeed's fp32 master partition under ZeRO >= 1), and the paper's bf16 mixed-precision figure
(20 bytes/param: 2 + 2 + 4 + 4 + 8) for the same layout.

    python benchmarks/bench_memory.py [--dp 2 4] [--zero 0 1 2 3] [--preset demo] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent))  # the repository root: testing.*
from results import benchmark_args, benchmark_parser, write_result  # noqa: E402

from testing.local_ranks import worker_rows, write_rows  # noqa: E402

MB = 1e6


def worker(out: Path, preset: str, stages: list[int]) -> None:
    import torch.distributed as dist

    from testing.lightning_run import fit, megatron_strategy
    from testing.state_bytes import StateBytesProbe

    world = int(os.environ["WORLD_SIZE"])
    rows = []
    for zero in stages:
        probe = StateBytesProbe()
        trainer = fit(
            megatron_strategy(zero=zero),
            devices=world,
            preset=preset,
            steps=2,
            micro_batch=1,
            global_batch=world,
            callbacks=[probe],
        )
        numel = sum(
            p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in trainer.lightning_module.model.parameters()
        )
        per_rank = [None] * world
        dist.all_gather_object(per_rank, probe.result.as_dict())
        rows.append({"zero": zero, "dp": world, "num_params": numel, "per_rank": per_rank})
    write_rows(out, rows)


def launch(dp: int, preset: str, stages: list[int]) -> list[dict]:
    return worker_rows(dp, __file__, "--preset", preset, "--zero", *stages, what=f"dp={dp} ")


def planner_bytes(num_params: int, dp: int, zero: int) -> dict:
    from mtnlg_lightning.planning.planner import model_state_bytes

    return {
        "fp32": model_state_bytes(num_params, dp, zero, "fp32"),
        "bf16_20_bytes": model_state_bytes(num_params, dp, zero, "bf16"),
    }


def report(rows: list[dict]) -> list[dict]:
    print(
        f"{'ZeRO':>4} {'dp':>3} {'params':>8} {'grads':>8} {'master':>8} {'moments':>8} {'measured':>9} "
        f"{'planner fp32':>12} {'ratio':>6} {'bf16 20 B/p':>11}   (MB per rank, max over ranks)"
    )
    out = []
    for row in rows:
        worst = max(row["per_rank"], key=lambda r: r["total"])
        plan = planner_bytes(row["num_params"], row["dp"], row["zero"])
        ratio = worst["total"] / plan["fp32"]
        print(
            f"{row['zero']:>4} {row['dp']:>3} {worst['params'] / MB:>8.2f} {worst['grads'] / MB:>8.2f} "
            f"{worst['master'] / MB:>8.2f} {worst['moments'] / MB:>8.2f} {worst['total'] / MB:>9.2f} "
            f"{plan['fp32'] / MB:>12.2f} {ratio:>6.3f} {plan['bf16_20_bytes'] / MB:>11.2f}"
        )
        out.append(
            {
                **row,
                "measured_max_rank": worst,
                "planner_fp32": plan["fp32"],
                "planner_bf16_20_bytes": plan["bf16_20_bytes"],
                "ratio_measured_to_planner": ratio,
            }
        )
    n = rows[0]["num_params"]
    print(
        f"{n / 1e6:.2f}M params, fp32 CPU runs. planner fp32 = 4 weights + 4 grads + 8 Adam moments per param "
        f"(+ 4 fp32 master under DeepSpeed ZeRO >= 1), sharded by ZeRO stage; the paper's bf16 accounting is "
        f"20 bytes/param at ZeRO-0 ({20 * n / MB:.1f} MB here)."
    )
    return out


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="data-parallel sizes (default 2 4)")
    parser.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3], help="ZeRO stages (default 0 1 2 3)")
    parser.add_argument("--preset", default="demo", help="model preset (default demo, 4.2M params)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # torchrun child: write rows here
    args = benchmark_args(parser)
    if args.worker:
        worker(Path(args.worker), args.preset, args.zero)
        return 0
    rows = [row for dp in args.dp for row in launch(dp, args.preset, args.zero)]
    result = report(sorted(rows, key=lambda r: (r["dp"], r["zero"])))
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
