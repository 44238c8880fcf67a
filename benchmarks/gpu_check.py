#!/usr/bin/env python
"""The GPU acceptance run in one command (scripts/gpu_check.sh): correctness on CUDA, then speed, into one JSON.

    bash scripts/gpu_check.sh                      # one or more NVIDIA GPUs: ~10 minutes, writes gpu_check.json
    python benchmarks/gpu_check.py --dry-run       # every stage at tiny sizes on CPU (the test suite runs this)

Stages, each timed and recorded (a failing stage is recorded with its error; the exit status is 1 if any failed):
  environment   versions, GPU name and count, bf16 support.
  equivalence   one device: the tiny model's 5 fp32 steps with compiled blocks (inductor) equal eager within 1e-5
                (losses) / 2e-5 (parameters), TF32 off; bf16-mixed within 1e-3 of fp32 losses. With 2+ GPUs also
                tp2, pp2 and dp2 ZeRO-1 (+ bf16 dp2 ZeRO-2) under torchrun with NCCL against the same reference
                (testing/dist_parallel_runs.py with MTNLG_TEST_ACCELERATOR=gpu).
  training      `mtnlg fit` of gpt3-1.3b (seq 2048) in bf16-mixed: eager and compiled blocks, without and with full
                activation checkpointing: median tokens/s, TFLOP/s and MFU per GPU of the steps after warm-up, peak
                memory.
  generation    benchmarks/bench_generate.py on the GPU: our KV-cache decoding vs transformers' generate, bf16.
  evaluation    benchmarks/bench_eval.py on the GPU: mtnlg-eval vs lm-evaluation-harness' HF backend (LAMBADA
                format), with the accuracies of both.
  gated_deltanet  Gated DeltaNet on flash-linear-attention's kernels (causal-conv1d's too, where installed) against
                its torch path, fp32 and bf16, two rows and a packed row of three documents: the output's and the
                input gradient's relative errors (testing/gated_deltanet_kernels.py argues the tolerances), then
                both paths' forward + backward time at Qwen3-Next's linear-attention shape. Skipped without
                flash-linear-attention (pip install 'mtnlg-lightning[linear-attention-kernels]').
--dry-run: the same stages on CPU with the tiny model, a few steps, the aot_eager backend (no C++ compilation),
2 gloo ranks for the distributed part, plain-torch stand-ins for Gated DeltaNet's kernels: it proves the script
runs end to end, not any speed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the repository root: testing.* (the equivalence harness the suite uses)
from mtnlg_lightning.outputs import write_json  # noqa: E402
from testing.local_ranks import run_on_ranks  # noqa: E402

LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5  # fp32, as tests/test_parallel_equivalence.py
BF16_LOSS_RTOL = 1e-3  # bf16 vs fp32 losses over 5 steps (the suite's bf16 section argues it)
DIST_RUNS = ["tp2", "pp2_1f1b", "dp2_zero1", "bf16_dp2_zero2"]
STAGES = ("equivalence", "training", "generation", "evaluation", "gated_deltanet")
# Qwen3-Next's linear attention (hidden 2048, 16 key and 32 value heads of 128), rows of 4096: the timing's shape
GDN_TIMING_SIZE = (2048, (16, 32), (128, 128))
GDN_TIMING_ROWS = {"sequence": [[4096], [4096]], "packed": [[700, 1300, 96, 2000], [4096]]}


def environment() -> dict:
    import lightning
    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": lightning.__version__,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "bf16": bool(cuda and torch.cuda.is_bf16_supported()),
    }


def max_rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def max_param_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def equivalence(dry_run: bool, gpus: int, tmp: Path) -> dict:
    import torch

    from testing.parallel_harness import tiny_run

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here (TF32 would be a 1e-3 difference)
    torch.backends.cudnn.allow_tf32 = False
    backend = "aot_eager" if dry_run else "inductor"
    ref, _ = tiny_run(max_steps=5)
    compiled, _ = tiny_run(max_steps=5, compile_backend=backend)
    bf16, _ = tiny_run(max_steps=5, precision="bf16-mixed")
    out = {
        "compile_backend": backend,
        "compiled_loss_rel": max_rel(compiled.losses, ref.losses),
        "compiled_param_diff": max_param_diff(compiled.params[5], ref.params[5]),
        "bf16_loss_rel": max_rel(bf16.losses, ref.losses),
    }
    checks = [
        out["compiled_loss_rel"] <= LOSS_RTOL,
        out["compiled_param_diff"] <= PARAM_ATOL,
        out["bf16_loss_rel"] <= BF16_LOSS_RTOL,
    ]
    if gpus >= 2 or dry_run:  # dry run: the same launch on 2 CPU ranks (gloo), one layout
        runs = ["tp2"] if dry_run else DIST_RUNS
        out["distributed"] = distributed(runs, ref, tmp / "dist", accelerator="cpu" if dry_run else "gpu")
        checks += [r["ok"] for r in out["distributed"].values()]
    else:
        out["distributed"] = "skipped: one GPU (NCCL layouts need 2)"
    out["ok"] = all(checks)
    return out


def distributed(runs: list[str], ref, out: Path, accelerator: str) -> dict:
    import torch

    env = {"MTNLG_TEST_ACCELERATOR": accelerator}
    proc = run_on_ranks(2, ROOT / "testing" / "dist_parallel_runs.py", out, *runs, env=env, cwd=ROOT, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"torchrun failed: {proc.stderr[-2000:]}")
    results = {}
    for name in runs:
        run = torch.load(out / f"{name}.pt", weights_only=False)
        loss_rel = max_rel(run["losses"][:5], ref.losses[:5])
        param = max_param_diff(run["params"][5], ref.params[5]) if not name.startswith("bf16") else None
        ok = loss_rel <= (BF16_LOSS_RTOL if name.startswith("bf16") else LOSS_RTOL)
        ok = ok and (param is None or param <= PARAM_ATOL)
        results[name] = {"loss_rel": loss_rel, "param_diff": param, "ok": ok}
    return results


def training(dry_run: bool, steps: int, tmp: Path) -> dict:
    """`mtnlg fit` of the model in bf16-mixed, eager / compiled x no / full activation checkpointing."""
    import torch

    from mtnlg_lightning.train.cli import main as mtnlg

    if dry_run:
        size = ["--model.preset", "tiny", "--trainer.accelerator", "cpu", "--model.compile_backend", "aot_eager"]
        steps = 2
    else:
        size = ["--model.preset", "gpt3-1.3b", "--model.model_overrides", "{seq_len: 2048}"]
        size += ["--trainer.accelerator", "gpu", "--model.micro_batch_size", "8", "--model.global_batch_size", "16"]
    results = {}
    for compiled in (False, True):
        for recompute in ("none", "full"):
            name = f"{'compiled' if compiled else 'eager'}_ac_{recompute}"
            directory = tmp / name
            argv = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), *size]
            argv += ["--trainer.precision", "bf16-mixed", "--trainer.max_steps", str(steps)]
            argv += ["--model.warmup_tokens", "0", "--model.compile", str(compiled).lower()]
            argv += ["--trainer.limit_val_batches", "0", "--trainer.deterministic", "false"]
            argv += ["--trainer.default_root_dir", str(directory), "--trainer.enable_progress_bar", "false"]
            argv += ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir"]
            argv += [str(directory)]
            if recompute != "none":
                argv += ["--trainer.callbacks+=mtnlg_lightning.callbacks.ActivationCheckpointing"]
                argv += ["--trainer.callbacks.mode", recompute]
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            try:
                mtnlg(argv)
            except SystemExit as exit_:
                if exit_.code:
                    raise RuntimeError(f"mtnlg fit ({name}) exited with {exit_.code}") from None
            wall = time.perf_counter() - started
            (metrics,) = list(directory.rglob("metrics.csv"))
            rows = [r for r in csv.DictReader(metrics.open()) if r.get("tokens_per_sec")]
            steady = rows[min(5, len(rows) - 1) :]  # warm-up steps (compilation, allocator, kernel selection) out
            losses = [float(r["train_loss"]) for r in rows]
            mfu = [float(r["mfu"]) for r in steady if r.get("mfu")]
            results[name] = {
                "steps": len(rows),
                "tokens_per_s": statistics.median(float(r["tokens_per_sec"]) for r in steady),
                "tflops_per_gpu": statistics.median(float(r["tflops_per_device"]) for r in steady),
                "mfu": statistics.median(mfu) if mfu else None,
                "first_loss": losses[0],
                "last_loss": losses[-1],
                "finite": all(x == x and abs(x) != float("inf") for x in losses),
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
                "wall_s": wall,
            }
            print(f"[gpu_check] training {name}: {results[name]['tokens_per_s']:,.0f} tokens/s", flush=True)
    eager = results["eager_ac_none"]["tokens_per_s"]
    for r in results.values():
        r["speedup_vs_eager"] = r["tokens_per_s"] / eager
    results["ok"] = all(r["finite"] and r["steps"] == steps for r in results.values() if isinstance(r, dict))
    return results


def script(name: str, args: list[str], tmp: Path) -> dict:
    """A benchmark script's JSON (they compare against transformers / lm-eval themselves, side by side)."""
    path = tmp / f"{name}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / name), *args, "--json", str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{name} failed: {proc.stderr[-2000:]}")
    return {**json.loads(path.read_text()), "ok": True}


def generation(dry_run: bool, tmp: Path) -> dict:
    if dry_run:
        args = ["--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "512", "--new-tokens", "8"]
        args += ["--batches", "1", "--repeats", "1", "--device", "cpu"]
    else:  # gpt3-1.3b-sized GPT-2 (24 layers, hidden 2048), bf16
        args = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--new-tokens", "128"]
        args += ["--batches", "1", "8", "32", "--repeats", "3", "--device", "cuda", "--dtype", "bf16"]
    return script("bench_generate.py", args, tmp)


def evaluation(dry_run: bool, tmp: Path) -> dict:
    if dry_run:
        args = ["--layers", "2", "--hidden", "64", "--heads", "2", "--docs", "8", "--repeats", "1", "--device", "cpu"]
    else:
        args = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--batch-size", "32", "--device", "cuda"]
        args += ["--dtype", "bf16"]
    return script("bench_eval.py", args, tmp)


def gated_deltanet(dry_run: bool) -> dict:
    import torch

    from mtnlg_lightning import fla_kernels
    from testing.gated_deltanet_kernels import STAND_INS, check, time_paths

    if dry_run:  # the comparison and the timing run, the torch rule standing in for the kernels
        kernels, device, rows = STAND_INS, "cpu", {"packed": [[30, 41, 29]]}
        size, repeats = (64, (2, 4), (16, 16)), 1
        out = {"kernels": "plain-torch stand-ins (dry run)"}
    else:
        kernels, device, rows = fla_kernels.kernels_for(torch.zeros(1, device="cuda")), "cuda", GDN_TIMING_ROWS
        size, repeats = GDN_TIMING_SIZE, 10
        if kernels is None:
            return {"ok": True, "kernels": "skipped: flash-linear-attention (>= 0.5) not installed"}
        import fla

        out = {"kernels": f"flash-linear-attention {fla.__version__}", "causal_conv1d": kernels.conv is not None}
    for dtype in (torch.float32, torch.bfloat16):
        for case in ("sequence", "packed"):
            out[f"{str(dtype).removeprefix('torch.')}_{case}"] = check(kernels, dtype, case, device)
    out["timing_bf16"] = {case: time_paths(kernels, lengths, size, device=device, repeats=repeats)
                          for case, lengths in rows.items()}  # fmt: skip
    out["ok"] = all(r["ok"] for r in out.values() if isinstance(r, dict) and "ok" in r)
    return out


def run_stage(results: dict, name: str, fn, *args) -> None:
    started = time.perf_counter()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        results[name] = fn(*args)
    except Exception as error:  # recorded, and the next stage still runs: one JSON says what worked
        results[name] = {"ok": False, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
    results[name]["seconds"] = time.perf_counter() - started
    print(f"[gpu_check] {name}: {'ok' if results[name].get('ok') else 'FAILED'} "
          f"({results[name]['seconds']:.0f} s)", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="every stage at tiny sizes on CPU (no CUDA needed)")
    p.add_argument("--output", default="gpu_check.json", help="the JSON of results (written atomically)")
    p.add_argument("--steps", type=int, default=25, help="training steps per variant (the first 5 are warm-up)")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES, help="stages to run, in this order")
    args = p.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the equivalence stage
    import torch

    env = environment()
    print(f"[gpu_check] {env}", flush=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA GPU visible (--dry-run runs every stage on CPU)", file=sys.stderr)
        return 2
    results = {"environment": env, "dry_run": args.dry_run, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ")}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp_dir:
        tmp = Path(tmp_dir)
        stages = {
            "equivalence": (equivalence, args.dry_run, env["gpus"], tmp),
            "training": (training, args.dry_run, args.steps, tmp),
            "generation": (generation, args.dry_run, tmp),
            "evaluation": (evaluation, args.dry_run, tmp),
            "gated_deltanet": (gated_deltanet, args.dry_run),
        }
        for name in args.stages:
            run_stage(results, name, *stages[name])
    ok = all(results[name].get("ok") for name in args.stages)
    results["ok"] = ok
    output = Path(args.output)
    write_json(output, results, default=str)
    summary = ", ".join(f"{name} {'ok' if results[name].get('ok') else 'FAILED'}" for name in args.stages)
    print(f"gpu_check: {summary}; results in {output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
