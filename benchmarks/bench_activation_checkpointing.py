"""Peak memory and step time of one training step per activation-checkpointing mode, on CPU, side by side.

    python benchmarks/bench_activation_checkpointing.py                  # 8 layers, seq 1024, hidden 256, batch 2
    python benchmarks/bench_activation_checkpointing.py --layers 4 --seq 512 --steps 1   # quicker

How memory is measured (CPU, honestly): each mode runs in a fresh Python process (no allocator state shared between
modes). glibc is told to serve every allocation above 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_, which also
disables its adaptive threshold), so memory torch frees goes straight back to the OS and the resident set size
follows the live tensors instead of a high-water mark of the heap. The process builds the model and AdamW, runs one
warm-up step (optimizer states now exist), then resets the kernel's peak-RSS counter (`echo 5 >
/proc/self/clear_refs`) and runs the measured step. "step peak" = peak RSS during that step minus RSS before it:
gradients + saved activations + temporaries (model weights and optimizer states, present before and after, are
excluded). tracemalloc would see nothing (torch allocates in C++), and ru_maxrss cannot be reset between steps;
when clear_refs is not permitted the script falls back to measuring the first step against a pre-step baseline
with optimizer states created up front (reported as such). Step time: median wall time of --steps further steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from model_shape import add_model_shape_args, shape_fields
from results import write_result

MODES = ("none", "selective", "every_n", "full")


def _rss_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _hwm_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(args) -> dict:
    import torch

    from mtnlg_lightning.callbacks import apply_activation_checkpointing
    from mtnlg_lightning.config import ModelConfig
    from mtnlg_lightning.loss import cross_entropy
    from mtnlg_lightning.model import build_model

    torch.manual_seed(0)
    config = ModelConfig(**shape_fields(args), name="bench")
    model = build_model(config)
    names = apply_activation_checkpointing(model, args.mode, args.every_n)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (args.batch, config.seq_len + 1))

    def step() -> float:
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # as MTNLGModule: gradients do not outlive the step
        return float(loss)

    can_reset = _reset_peak()
    if can_reset:
        step()  # warm-up: optimizer states, thread pools, kernels
        before = _rss_kib()
        _reset_peak()
    else:  # ru_maxrss cannot be reset: measure the first step, with the optimizer states created beforehand
        for p in model.parameters():
            optimizer.state[p]["exp_avg"] = torch.zeros_like(p)
            optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p)
            optimizer.state[p]["step"] = torch.tensor(0.0)
        before = _rss_kib()
    loss = step()
    peak = _hwm_kib()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    return {
        "mode": args.mode,
        "checkpointed": len(names),
        "loss": loss,
        "rss_before_mib": before / 1024,
        "step_peak_mib": (peak - before) / 1024,
        "step_s": statistics.median(times) if times else float("nan"),
        "params": params,
        "peak_method": "clear_refs" if can_reset else "ru_maxrss-first-step",
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_shape_args(parser, layers=8, hidden=256, heads=4, vocab=4096, seq=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--every-n", dest="every_n", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode (after the measured one)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", help="also write the per-mode figures to this JSON file")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(child(args)))
        return

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    passthrough = [
        f"--layers={args.layers}",
        f"--seq={args.seq}",
        f"--hidden={args.hidden}",
        f"--heads={args.heads}",
        f"--vocab={args.vocab}",
        f"--batch={args.batch}",
        f"--every-n={args.every_n}",
        f"--steps={args.steps}",
    ]
    results = []
    for mode in args.modes.split(","):
        out = subprocess.run(
            [sys.executable, __file__, f"--mode={mode}", *passthrough],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(f"  measured {mode}", file=sys.stderr, flush=True)

    first = results[0]
    print(
        f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, batch {args.batch}, "
        f"vocab {args.vocab} ({first['params'] / 1e6:.1f}M params), fp32 CPU, {first['threads']} threads, "
        f"peak via {first['peak_method']}"
    )
    print(f"weights + AdamW states resident before the step: {first['rss_before_mib']:.0f} MiB (process total)")
    base = next((r for r in results if r["mode"] == "none"), first)
    header = (
        f"{'mode':<10} {'recomputed':>10} {'step peak MiB':>14} {'vs none':>8} {'step s':>8} {'time vs none':>13} "
        f"{'loss':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        mem = r["step_peak_mib"] / base["step_peak_mib"] - 1
        slow = r["step_s"] / base["step_s"] - 1
        print(
            f"{r['mode']:<10} {r['checkpointed']:>10} {r['step_peak_mib']:>14.0f} {mem:>+8.0%} {r['step_s']:>8.2f} "
            f"{slow:>+13.0%} {r['loss']:>8.4f}"
        )
    print("step peak = peak RSS during one training step minus RSS before it (grads + activations + temporaries).")
    write_result(args.json, results)


if __name__ == "__main__":
    main()
