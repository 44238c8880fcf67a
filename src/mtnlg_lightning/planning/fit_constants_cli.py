"""Grid search of the cost model's fitted efficiency constants for one GPU family against its published runs
(mtnlg_lightning/planning/published_runs.yaml): settings ranked by runs within +-15%, then by the smallest worst error.

    mtnlg-fit-planner-constants a100 [--top 10]
    mtnlg-fit-planner-constants h100
"""

import argparse
import dataclasses
import itertools
import sys

from mtnlg_lightning import gpus
from mtnlg_lightning.planning.planner_validation import load_runs, predict, throughput_error

GPU_FAMILIES = {"a100": ("a100-80g", "a100-40g"), "h100": ("h100",)}
GRID = {
    "gemm_efficiency": [0.60, 0.62, 0.64, 0.66, 0.68, 0.70, 0.72, 0.74, 0.76],
    "gemm_half_width": [50, 100, 150, 200, 250, 300, 400],
    "attention_efficiency": [0.25, 0.30, 0.35, 0.45, 0.50, 0.55, 0.60, 0.70],
    "hbm_efficiency": [0.5, 0.6, 0.7],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="mtnlg-fit-planner-constants", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("gpu_family", metavar="family", choices=sorted(GPU_FAMILIES))
    parser.add_argument("--top", type=int, default=10, help="print the best N settings (default: %(default)s)")
    args = parser.parse_args(argv)
    names = GPU_FAMILIES[args.gpu_family]
    _, runs = load_runs()
    runs = [run for run in runs if run.gpu in names]
    original = {name: gpus.GPUS[name] for name in names}
    current = {k: getattr(original[names[0]], k) for k in GRID}
    results = []
    try:
        for values in itertools.product(*GRID.values()):
            setting = dict(zip(GRID, values, strict=True))
            for name in names:
                gpus.GPUS[name] = dataclasses.replace(original[name], **setting)
            errors = [throughput_error(run, predict(run)) for run in runs]
            inside = sum(abs(e) <= 0.15 for e in errors)
            results.append((inside, max(abs(e) for e in errors), min(errors), max(errors), setting))
    finally:
        gpus.GPUS.update(original)
    results.sort(key=lambda r: (-r[0], r[1]))
    print(f"{args.gpu_family}: {len(runs)} runs; current constants {current}")
    for inside, worst, low, high, setting in results[: args.top]:
        print(f"  {inside}/{len(runs)} within 15%, worst {worst:.1%} ({low:+.1%} .. {high:+.1%}): {setting}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
