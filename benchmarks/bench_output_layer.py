#!/usr/bin/env python
"""The output layer's memory and time: the LM head and cross-entropy in one piece against in chunks
(`parallel/output_layer.py`), forward and backward of one micro-batch, at vocabularies of 49k (SmolLM2), 128k
(Llama 3) and 152k (Qwen 3).

Each measurement runs in its own process, one after the other (the peak resident memory of a process only grows):
what the loss's forward and backward add to the peak over the inputs, the head's weight and its gradient already
allocated; then the median seconds of `--repeats` more calls. The ratios are of runs made side by side in this one
invocation.

    python benchmarks/bench_output_layer.py [--tokens 2048] [--hidden 576] [--vocab 49152 128256 151936]
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
from results import benchmark_args, benchmark_parser, ratio, report  # noqa: E402

MODES = {"one piece": 0, "chunked (auto)": None}


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(tokens: int, hidden: int, vocab: int, chunk_tokens: int | None, repeats: int, threads: int) -> dict:
    """One mode at one vocabulary, in this process."""
    import torch

    from mtnlg_lightning.model import OutputHead
    from mtnlg_lightning.parallel.output_layer import OutputLoss

    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)

    class Owner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = OutputHead(hidden, vocab, bias=False)

    owner = Owner()
    owner.lm_head.weight.grad = torch.zeros_like(owner.lm_head.weight)  # what any step holds: not the loss's cost
    states = torch.randn(1, tokens, hidden, generator=generator).requires_grad_()
    states.grad = torch.zeros_like(states)
    labels = torch.randint(0, vocab, (1, tokens), generator=generator)
    loss_fn = OutputLoss(owner, vocab, chunk_tokens=chunk_tokens)
    before = peak_mib()
    loss_fn(states, labels).backward()
    added = peak_mib() - before
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        loss_fn(states, labels).backward()
        seconds.append(time.perf_counter() - started)
    return {"peak_added_mib": added, "seconds": statistics.median(seconds), "chunk": loss_fn.chunk_size(tokens)}


def run_child(args, vocab: int, mode: str) -> dict:
    command = [sys.executable, __file__, "--child", json.dumps([vocab, MODES[mode]]), "--tokens", str(args.tokens)]
    command += ["--hidden", str(args.hidden), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        raise SystemExit(f"the {mode} run at vocabulary {vocab} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(result: dict) -> None:
    print(f"output layer, {result['tokens']} tokens x hidden {result['hidden']}, fp32, {result['threads']} thread(s)")
    print(f"{'vocab':>8} {'logits MiB':>10} {'mode':>15} {'chunk':>6} {'peak +MiB':>10} {'s/step':>8}")
    for row in result["rows"]:
        for mode in MODES:
            m = row[mode]
            print(f"{row['vocab']:>8} {row['logits_mib']:>10.0f} {mode:>15} {m['chunk']:>6} "
                  f"{m['peak_added_mib']:>10.0f} {m['seconds']:>8.3f}")  # fmt: skip
        print(f"{'':>8} memory one piece / chunked {row['memory_ratio']:.2f}x, time chunked / one piece "
              f"{row['time_ratio']:.2f}x")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the micro-batch (default 2048)")
    parser.add_argument("--hidden", type=int, default=576, help="hidden size (default 576, SmolLM2-135M's)")
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256, 151936], help="vocabularies")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per mode after the first (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run (default 1)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one measurement, in its own process
    args = benchmark_args(parser, argv)
    if args.child:
        vocab, chunk = json.loads(args.child)
        print(json.dumps(measure(args.tokens, args.hidden, vocab, chunk, args.repeats, args.threads)))
        return 0
    rows = []
    for vocab in args.vocab:
        row = {"vocab": vocab, "logits_mib": args.tokens * vocab * 4 / 2**20}
        for mode in MODES:
            row[mode] = run_child(args, vocab, mode)
        one, chunked = row["one piece"], row["chunked (auto)"]
        row["memory_ratio"] = ratio(one["peak_added_mib"], chunked["peak_added_mib"])
        row["time_ratio"] = ratio(chunked["seconds"], one["seconds"])
        rows.append(row)
    result = {"tokens": args.tokens, "hidden": args.hidden, "threads": args.threads, "rows": rows}
    return report(result, args.json, print_table)


if __name__ == "__main__":
    sys.exit(main())
