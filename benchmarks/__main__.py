"""Run every CPU benchmark, print one table (figure, ours, baseline, ratio, target) and write JSON.

    python -m benchmarks [--json results.json] [--only overhead parallel ...] [--logs DIR]

Each benchmark runs as its own subprocess (a crash is reported and the rest still run) with options small enough
for a 2-core machine (benchmarks/suite.py); its full output goes to DIR/NAME.log. Exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.suite import SUITE

HERE = Path(__file__).resolve().parent


def fmt(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.3f}" if abs(x) < 10 else f"{x:,.1f}"


def run(bench, logs: Path) -> dict:
    out = logs / f"{bench.name}.json"
    cmd = [sys.executable, str(HERE / bench.script), *bench.args, "--json", str(out)]
    started = time.perf_counter()
    print(f"[benchmarks] {bench.name}: {' '.join(cmd[1:])}", flush=True)
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(HERE.parent / "src")}
    with open(logs / f"{bench.name}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=HERE.parent)
    seconds = time.perf_counter() - started
    result = {
        "name": bench.name,
        "seconds": seconds,
        "returncode": proc.returncode,
        "log": str(logs / f"{bench.name}.log"),
    }
    if proc.returncode == 0 and out.exists():
        result["data"] = json.loads(out.read_text())
        try:
            result["rows"] = [list(r) for r in bench.rows(result["data"])]
        except Exception as error:  # noqa: BLE001 - a changed JSON shape is a failure of that benchmark only
            result["error"] = f"could not read its JSON: {error!r}"
    else:
        tail = (logs / f"{bench.name}.log").read_text()[-1500:]
        result["error"] = f"exit {proc.returncode}" + ("" if out.exists() else ", no JSON") + f"\n{tail}"
    print(f"[benchmarks] {bench.name}: {'ok' if 'rows' in result else 'FAILED'} in {seconds:.0f} s", flush=True)
    return result


def table(results: list[dict]) -> str:
    lines = [f"{'figure':<98} {'ours':>10} {'baseline':>10} {'ratio':>7}  target", "-" * 140]
    for r in results:
        for figure, ours, baseline, ratio, target in r.get("rows", []):
            lines.append(f"{figure:<98} {fmt(ours):>10} {fmt(baseline):>10} {fmt(ratio):>7}  {target}")
        if "error" in r:
            lines.append(f"{r['name']}: FAILED ({r['error'].splitlines()[0]}; log {r['log']})")
    lines.append("-" * 140)
    lines.append(
        "  ".join(f"{r['name']} {r['seconds']:.0f}s" for r in results)
        + f"  | total {sum(r['seconds'] for r in results) / 60:.1f} min"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write every benchmark's figures and rows here")
    parser.add_argument("--only", nargs="+", choices=[b.name for b in SUITE], help="run only these")
    parser.add_argument("--logs", help="folder for each benchmark's output and JSON (default: a temporary one)")
    args = parser.parse_args()
    logs = Path(args.logs or tempfile.mkdtemp(prefix="mtnlg_benchmarks_"))
    logs.mkdir(parents=True, exist_ok=True)
    results = [run(b, logs) for b in SUITE if not args.only or b.name in args.only]
    print("\n" + table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if any("rows" not in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
