"""bf16-mixed against fp32 over a demo-sized run: the loss curves of `mtnlg fit --config configs/demo.yaml` (the demo
preset, its recipe and data, 300 steps) in both precisions, side by side in one invocation.

    python benchmarks/bench_bf16_curve.py --steps 300 --json out.json

The curves are compared after a 10-step moving average (a step's loss is the mean over one batch: its batch-to-batch
noise is the same in both runs and is not what precision changes). Reported: the largest gap of the smoothed
curves after warm-up, the gap at the end, and the relative gap of the final validation loss. The band the gap
must stay in (`--band`, nats) is stated with the result; on CPU, bf16-mixed runs through autocast, as Lightning
runs it on one GPU (the 3D strategy's bf16 weights with fp32 masters are tested for equivalence in the suite).
Too slow for the test suite (two 300-step runs); run it once and quote its figures.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import write_result

ROOT = Path(__file__).resolve().parents[1]


def run_fit(precision: str, steps: int, directory: Path) -> tuple[dict[int, float], float | None, float]:
    """Train the demo in `precision` with its config (checkpoints and logs under `directory`): per-step train loss,
    the last val_loss and the wall time."""
    args = [sys.executable, "-m", "mtnlg_lightning.train.cli", "fit", "--config", str(ROOT / "configs" / "demo.yaml")]
    args += ["--trainer.precision", precision, "--trainer.max_steps", str(steps), "--trainer.accelerator", "cpu"]
    args += ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(directory)]
    args += ["--trainer.enable_progress_bar", "false"]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT / "src")}
    started = time.perf_counter()
    # cwd: the demo config writes its checkpoints to runs/demo relative to it
    result = subprocess.run(args, cwd=directory, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"bench_bf16_curve: error: {precision} run failed:\n{result.stderr[-3000:]}")
    losses, val = {}, None
    for path in directory.rglob("metrics.csv"):
        for row in csv.DictReader(path.open()):
            if row.get("train_loss"):
                losses[int(row["step"])] = float(row["train_loss"])
            if row.get("val_loss"):
                val = float(row["val_loss"])
    return losses, val, seconds


def smooth(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def compare(fp32: dict[int, float], bf16: dict[int, float], window: int, warmup: int) -> dict:
    steps = sorted(set(fp32) & set(bf16))
    a, b = smooth([fp32[s] for s in steps], window), smooth([bf16[s] for s in steps], window)
    gaps = [abs(x - y) for x, y in zip(a, b, strict=True)][warmup:]
    return {
        "steps": len(steps),
        "max_smoothed_gap": max(gaps),
        "final_smoothed_gap": gaps[-1],
        "mean_smoothed_gap": sum(gaps) / len(gaps),
        "fp32_final_smoothed_loss": a[-1],
        "bf16_final_smoothed_loss": b[-1],
        "fp32_first_loss": fp32[steps[0]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps of each run (the demo's 300)")
    p.add_argument("--window", type=int, default=10, help="moving-average window of the compared curves, steps")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the gap (the first, steepest ones)")
    p.add_argument("--band", type=float, default=0.05, help="the largest smoothed gap accepted, nats")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bf16_curve_") as tmp:
        runs = {}
        for precision in ("32-true", "bf16-mixed"):
            directory = Path(tmp) / precision
            directory.mkdir()
            print(f"[bench_bf16_curve] {precision}: {args.steps} steps ...", flush=True)
            runs[precision] = run_fit(precision, args.steps, directory)
            print(f"[bench_bf16_curve] {precision}: {runs[precision][2]:.0f}s", flush=True)
    (fp32, fp32_val, fp32_s), (bf16, bf16_val, bf16_s) = runs["32-true"], runs["bf16-mixed"]
    result = compare(fp32, bf16, args.window, args.warmup)
    result.update(
        band=args.band,
        within_band=result["max_smoothed_gap"] <= args.band,
        fp32_val_loss=fp32_val,
        bf16_val_loss=bf16_val,
        val_loss_rel_gap=abs(bf16_val - fp32_val) / fp32_val if fp32_val and bf16_val else None,
        fp32_seconds=fp32_s,
        bf16_seconds=bf16_s,
        window=args.window,
        warmup=args.warmup,
    )
    print(
        f"bf16 vs fp32 over {result['steps']} demo steps: smoothed loss gap max {result['max_smoothed_gap']:.4f}, "
        f"mean {result['mean_smoothed_gap']:.4f}, final {result['final_smoothed_gap']:.4f} nats "
        f"(band {args.band}: {'within' if result['within_band'] else 'OUTSIDE'}); final loss fp32 "
        f"{result['fp32_final_smoothed_loss']:.3f} bf16 {result['bf16_final_smoothed_loss']:.3f}; val_loss fp32 "
        f"{fp32_val} bf16 {bf16_val}; {fp32_s:.0f}s / {bf16_s:.0f}s"
    )
    write_result(args.json, result, indent=2)
    return 0 if result["within_band"] else 1


if __name__ == "__main__":
    sys.exit(main())
