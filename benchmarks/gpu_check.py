#!/usr/bin/env python
"""GPU check in one command: ~30 steps of `mtnlg fit` on a ~1.3B-parameter model, bf16, flash SDPA, fused AdamW.

    python benchmarks/gpu_check.py            # on one NVIDIA GPU: gpt3-1.3b, seq 2048, prints tokens/s, TFLOP/s, MFU
    python benchmarks/gpu_check.py --cpu-smoke   # no GPU: the tiny model for a few steps (CI runs this)

Exits non-zero on any error. Without a GPU and without --cpu-smoke it fails (a GPU check that silently ran on CPU
would be misleading).
"""

import argparse
import csv
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def environment() -> str:
    import lightning
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (
        f"python {platform.python_version()} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
        f"lightning {lightning.__version__} | GPU {gpu} | flash SDPA "
        f"{torch.backends.cuda.flash_sdp_enabled() if torch.cuda.is_available() else 'n/a'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="run the tiny model on CPU (no GPU needed)")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--preset", default="gpt3-1.3b", help="model preset on GPU (default gpt3-1.3b)")
    parser.add_argument("--micro-batch", type=int, default=8, help="micro-batch size on GPU (default 8)")
    parser.add_argument("--global-batch", type=int, default=16, help="global batch on GPU (default 16)")
    args = parser.parse_args()

    import torch

    from mtnlg_lightning.cli import main as mtnlg

    print(environment(), flush=True)
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("gpu_check: error: no CUDA GPU visible (use --cpu-smoke for the CPU smoke test)", file=sys.stderr)
        return 2
    if args.cpu_smoke:
        steps, overrides = min(args.steps, 6), ["--model.preset", "tiny", "--trainer.accelerator", "cpu"]
    else:
        steps = args.steps
        overrides = [
            "--model.preset",
            args.preset,
            "--model.model_overrides",
            "{seq_len: 2048}",
            "--trainer.accelerator",
            "gpu",
            "--trainer.precision",
            "bf16-mixed",
            "--model.micro_batch_size",
            str(args.micro_batch),
            "--model.global_batch_size",
            str(args.global_batch),
            "--model.warmup_tokens",
            "0",
        ]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        argv = [
            "fit",
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            *overrides,
            "--trainer.max_steps",
            str(steps),
            "--trainer.limit_val_batches",
            "0",
            "--trainer.deterministic",
            "false",
            "--trainer.default_root_dir",
            tmp,
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.logger",
            "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir",
            tmp,
        ]
        try:
            mtnlg(argv)
        except SystemExit as exit_:
            if exit_.code:
                return int(exit_.code)
        wall = time.perf_counter() - start
        (metrics,) = list(Path(tmp).rglob("metrics.csv"))
        rows = [r for r in csv.DictReader(metrics.open()) if r.get("tokens_per_sec")]
    if len(rows) != steps:
        print(f"gpu_check: error: expected {steps} logged steps, got {len(rows)}", file=sys.stderr)
        return 1
    steady = rows[min(5, len(rows) - 1) :]  # skip warm-up steps (allocator, kernel selection)
    tokens = statistics.median(float(r["tokens_per_sec"]) for r in steady)
    tflops = statistics.median(float(r["tflops_per_device"]) for r in steady)
    mfu = [float(r["mfu"]) for r in steady if r.get("mfu")]
    losses = [float(r["train_loss"]) for r in rows]
    if not all(map(lambda x: x == x and abs(x) != float("inf"), losses)):
        print("gpu_check: error: non-finite loss", file=sys.stderr)
        return 1
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    print(
        f"steps {steps} | loss {losses[0]:.3f} -> {losses[-1]:.3f} | median tokens/s {tokens:,.0f} | "
        f"TFLOP/s per GPU {tflops:.1f} | MFU {statistics.median(mfu):.1%}"
        if mfu
        else f"steps {steps} | loss {losses[0]:.3f} -> {losses[-1]:.3f} | median tokens/s {tokens:,.0f} | "
        f"TFLOP/s {tflops:.3f} | MFU n/a (unknown peak)"
    )
    print(f"peak GPU memory {peak_mem:.1f} GiB | wall time {wall:.0f} s (including start-up)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    sys.exit(main())
