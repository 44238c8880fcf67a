"""The planner's cost model against published training runs (mtnlg_lightning/planning/published_runs.yaml):
predicted vs published throughput per run, and where a search over the same model, GPU count and batch ranks the
published layout. Prints a Markdown table (the one on the documentation's
"Plan a layout" page), or JSON.

    mtnlg-validate-planner [--runs FILE] [--no-rank] [--json]
"""

import argparse
import json
import sys

from mtnlg_lightning.errors import run_main
from mtnlg_lightning.planning.planner_validation import DEFAULT_PATH, load_runs, validation_table


def markdown(rows: list[dict], with_rank: bool) -> str:
    head = (
        "| run | GPUs | layout (+ planner's pick of unpublished knobs) | published | s/iter published / predicted "
        "| model TFLOP/s/GPU published / predicted | error |"
    )
    rule = "|---|---:|---|---|---:|---:|---:|"
    if with_rank:
        head += " search rank (time vs best) |"
        rule += "---|"
    lines = [head, rule]
    for r in rows:
        line = (
            f"| {r['name']} | {r['gpus']} | {r['layout']} ({r['chosen']}) | {r['published_figure']} | "
            f"{r['published_seconds']:.2f} / {r['predicted_seconds']:.2f} | "
            f"{r['published_model_tflops']:.1f} / {r['predicted_model_tflops']:.1f} | {r['error']:+.1%} |"
        )
        if with_rank:
            rank = "-" if r["rank"] is None else f"{r['rank']} ({r['vs_best']:.2f}x)"
            line += f" {rank} |"
        lines.append(line)
    inside = sum(abs(r["error"]) <= 0.15 for r in rows)
    lines.append("")
    lines.append(f"{inside} of {len(rows)} runs predicted within +-15% of the published throughput.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="mtnlg-validate-planner", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", default=None, help="published runs YAML (default: the one shipped with the planner)")
    parser.add_argument("--no-rank", action="store_true", help="skip the search ranking (faster)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a Markdown table")
    args = parser.parse_args(argv)

    def body() -> None:
        _, runs = load_runs(args.runs or DEFAULT_PATH)
        rows = validation_table(runs, with_rank=not args.no_rank)
        print(json.dumps(rows, indent=1) if args.json else markdown(rows, not args.no_rank))

    return run_main("mtnlg-validate-planner", body)


if __name__ == "__main__":
    sys.exit(main())
