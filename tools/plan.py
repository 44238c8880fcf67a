#!/usr/bin/env python
"""Memory and throughput planner: does a (TP, PP, DP) layout fit, and how long is an iteration?

    python tools/plan.py --model mtnlg-530b --tp 8 --pp 35 --dp 16 --gpus-per-node 8 --gpu a100-80g \\
        --global-batch 1920 --micro-batch 1 --recompute full
    python tools/plan.py --model gpt3-175b --gpus 1024 --gpus-per-node 8 --gpu h100 --global-batch 1536 --search
"""

import argparse
import json
import sys

import _bootstrap  # noqa: F401

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.planner import GPU_MEMORY_BYTES, RECOMPUTE_MODES, format_plan, plan, search


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mtnlg-530b", help="model preset name (default: mtnlg-530b)")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel size (inside a node)")
    parser.add_argument("--pp", type=int, default=35, help="pipeline-parallel stages")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--gpus", type=int, help="cluster size for --search (default: tp x pp x dp)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (NVLink domain)")
    parser.add_argument("--gpu", default="a100-80g", choices=sorted(GPU_MEMORY_BYTES), help="GPU type (memory, peak)")
    parser.add_argument("--global-batch", type=int, default=1920, help="sequences per iteration")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--recompute", default="full", choices=RECOMPUTE_MODES, help="activation recomputation")
    parser.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage over DP")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="training precision")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed efficiency of busy time (default 0.4)")
    parser.add_argument("--search", action="store_true", help="rank every valid layout that fits, fastest first")
    parser.add_argument("--top", type=int, default=10, help="layouts shown by --search")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    try:
        config = get_config(args.model)
        if args.search:
            gpus = args.gpus or args.tp * args.pp * args.dp
            plans = search(config, gpus, args.gpus_per_node, args.gpu, args.global_batch, args.mfu, args.precision)
            if args.json:
                print(json.dumps([p.as_dict() for p in plans[: args.top]], indent=1))
            else:
                print(f"{len(plans)} layouts of {gpus} x {args.gpu} fit {args.model}; fastest {args.top}:")
                print(
                    f"{'tp':>3} {'pp':>3} {'dp':>5} {'mb':>3} {'recompute':>9} {'zero':>4} {'GB/GPU':>7} "
                    f"{'bubble':>7} {'s/iter':>8} {'TFLOP/s':>8}"
                )
                for p in plans[: args.top]:
                    print(
                        f"{p.tp:>3} {p.pp:>3} {p.dp:>5} {p.micro_batch:>3} {p.recompute:>9} {p.zero_stage:>4} "
                        f"{p.total_gb:>7.1f} {p.bubble:>7.1%} {p.iteration_seconds:>8.2f} {p.tflops_per_gpu:>8.1f}"
                    )
            return 0 if plans else 1
        result = plan(
            config,
            args.tp,
            args.pp,
            args.dp,
            args.gpus_per_node,
            args.gpu,
            args.global_batch,
            args.micro_batch,
            args.recompute,
            args.zero_stage,
            args.mfu,
            args.precision,
        )
    except MTNLGError as error:
        print(f"plan: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict(), indent=1) if args.json else format_plan(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
