#!/usr/bin/env python
"""Compiled blocks vs eager: training-step time of the same model, data and seed, side by side in one process.

    python benchmarks/bench_compile.py [--preset tiny --steps 6 --backends inductor --device cpu --json out.json]

Each variant builds the model from the same seed, compiles every block (`model.compile: true`,
`mtnlg_lightning.model.compile_blocks`) with the given torch.compile backend or none (eager), and runs --steps
training steps (forward, backward, AdamW) on the same random batch. Reported per variant: the first step (it
includes the compilation, or loading it from inductor's cache when an earlier run left one in
/tmp/torchinductor_*), the median of the following steps, its ratio to eager, and the first step's loss (compiled
and eager must agree: same model, fp32). `--bf16` runs under bf16 autocast; `--activation-checkpointing full`
recomputes every block. On CPU, inductor generates C++ (g++) kernels: its compilation takes minutes on 2 cores.
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from results import benchmark_args, benchmark_parser, write_result  # noqa: E402

from mtnlg_lightning.config import get_config  # noqa: E402
from mtnlg_lightning.model import build_model, compile_blocks  # noqa: E402


def measure(
    preset: str,
    backend: str,
    steps: int,
    batch: int,
    device: str = "cpu",
    bf16: bool = False,
    activation_checkpointing: str = "none",
    seq_len: int | None = None,
) -> dict:
    """Train `steps` + 1 steps of `preset` ("eager" or a torch.compile backend); the per-step wall times."""
    from mtnlg_lightning.callbacks import apply_activation_checkpointing

    torch.manual_seed(0)
    config = get_config(preset, **({"seq_len": seq_len} if seq_len else {}))
    model = build_model(config).to(device).train()
    apply_activation_checkpointing(model, activation_checkpointing)
    if backend != "eager":
        compile_blocks(model, backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.startswith("cuda") or None)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), device=device)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if bf16 else nullcontext()
    seconds, losses = [], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        with autocast:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
    step = statistics.median(seconds[1:])
    return {
        "backend": backend,
        "first_step_s": seconds[0],
        "step_s": step,
        "tokens_per_s": batch * config.seq_len / step,
        "first_loss": losses[0],
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--preset", default="tiny", help="model preset (tiny, demo, gpt3-125m, gpt3-1.3b, ...)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps after the first (compiling) one")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--backends", nargs="+", default=["inductor"], help="torch.compile backends compared with eager")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 otherwise)")
    ap.add_argument("--activation-checkpointing", default="none", choices=["none", "selective", "full"])
    args = benchmark_args(ap, argv)
    common = dict(
        preset=args.preset,
        steps=args.steps,
        batch=args.batch,
        device=args.device,
        bf16=args.bf16,
        activation_checkpointing=args.activation_checkpointing,
    )
    eager = measure(backend="eager", **common)
    result = {"preset": args.preset, "device": args.device, "bf16": args.bf16, "eager": eager, "compiled": {}}
    print(f"# bench_compile: {args.preset} ({eager['parameters'] / 1e6:.1f}M parameters) on {args.device}, "
          f"batch {args.batch}, {'bf16' if args.bf16 else 'fp32'}, activation checkpointing "
          f"{args.activation_checkpointing}")  # fmt: skip
    print(f"eager: step {eager['step_s'] * 1e3:.1f} ms (first {eager['first_step_s']:.1f} s)")
    for backend in args.backends:
        compiled = measure(backend=backend, **common)
        compiled["speedup"] = eager["step_s"] / compiled["step_s"]
        compiled["first_loss_diff"] = abs(compiled["first_loss"] - eager["first_loss"])
        result["compiled"][backend] = compiled
        print(
            f"{backend}: step {compiled['step_s'] * 1e3:.1f} ms (first, compiling: {compiled['first_step_s']:.1f} s)"
            f" | speed-up vs eager {compiled['speedup']:.2f}x | first loss diff {compiled['first_loss_diff']:.1e}"
        )
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
