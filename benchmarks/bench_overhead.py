#!/usr/bin/env python
"""Framework overhead: tokens/s of `mtnlg fit` machinery vs a minimal hand-written PyTorch loop, side by side.

Same model (preset, seed), same data batches, same AdamW recipe and clipping; the two alternate in one process
for --repeats rounds and the ratio of median step times is printed (this machine is noisy: compare within a run).

    python benchmarks/bench_overhead.py [--preset gpt3-125m --seq-len 128 --steps 6 --repeats 3]
"""

import math
import os
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the repository root: testing.*

import lightning as L  # noqa: E402
import torch  # noqa: E402
from results import add_rounds_arg, benchmark_args, benchmark_parser, write_result  # noqa: E402

from mtnlg_lightning.data.datamodule import GPTDataModule  # noqa: E402
from mtnlg_lightning.model import build_model  # noqa: E402
from mtnlg_lightning.train.module import MTNLGModule, cross_entropy  # noqa: E402
from testing.lightning_run import quiet_trainer  # noqa: E402


class StepTimer(L.Callback):
    def __init__(self):
        self.times = []

    def on_train_batch_start(self, *args):
        self.times.append(time.perf_counter())

    def on_train_end(self, *args):
        self.times.append(time.perf_counter())


def module_kwargs(args):
    return dict(
        preset=args.preset,
        model_overrides={"seq_len": args.seq_len, "max_position_embeddings": 2048},
        micro_batch_size=args.micro_batch,
        global_batch_size=args.global_batch,
        lr=1e-4,
        min_lr=1e-5,
        warmup_tokens=0,
        decay_tokens=10**9,
        grad_clip=1.0,
    )


def run_lightning(args) -> list[float]:
    L.seed_everything(1234, verbose=False)
    timer = StepTimer()
    trainer = quiet_trainer(
        accelerator="auto", devices=1, precision="32-true", max_steps=args.steps, log_every_n_steps=1, callbacks=[timer]
    )
    trainer.fit(MTNLGModule(**module_kwargs(args)), GPTDataModule(builtin_corpus="python-docs"))
    return [b - a for a, b in pairwise(timer.times)]


def run_plain(args, batches) -> list[float]:
    """What a user would write by hand: forward, backward per micro-batch, clip, AdamW step."""
    torch.manual_seed(1234)
    module = MTNLGModule(**module_kwargs(args))
    model = build_model(module.config)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    times = []
    for tokens in batches:
        start = time.perf_counter()
        chunks = tokens.split(args.micro_batch)
        for chunk in chunks:
            loss = cross_entropy(model(chunk[:, :-1]), chunk[:, 1:])
            (loss / len(chunks)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # the Lightning run also materialises the loss for logging each step
        times.append(time.perf_counter() - start)
    return times


def data_batches(args):
    from mtnlg_lightning.data.gpt_dataset import GPTDataset
    from mtnlg_lightning.data.indexed import IndexedDataset
    from mtnlg_lightning.demo.builtin_corpus import build_demo_data

    dataset = GPTDataset(
        IndexedDataset(build_demo_data(progress=False)[0]),
        (0, 500),
        args.seq_len,
        args.steps * args.global_batch,
        seed=1,
    )
    return [
        torch.from_numpy(
            __import__("numpy").stack([dataset[i * args.global_batch + j] for j in range(args.global_batch)])
        )
        for i in range(args.steps)
    ]


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--preset", default="gpt3-125m", help="model preset (default gpt3-125m)")
    parser.add_argument("--seq-len", type=int, default=128, help="sequence length (default 128)")
    parser.add_argument("--micro-batch", type=int, default=2, help="micro-batch size (default 2)")
    parser.add_argument("--global-batch", type=int, default=4, help="global batch (default 4)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first 2 are warm-up")
    add_rounds_arg(parser, 3, "--repeats")
    args = benchmark_args(parser)
    os.environ.setdefault("WANDB_MODE", "offline")
    batches = data_batches(args)
    lightning_steps, plain_steps = [], []
    for round_ in range(args.repeats):
        lightning_steps += run_lightning(args)[2:]
        plain_steps += run_plain(args, batches)[2:]
        print(
            f"round {round_ + 1}/{args.repeats}: lightning {statistics.median(lightning_steps):.3f} s/step, "
            f"plain {statistics.median(plain_steps):.3f} s/step",
            flush=True,
        )
    tokens = args.global_batch * args.seq_len
    result = {
        "preset": args.preset,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "mtnlg_fit_tokens_per_s": tokens / statistics.median(lightning_steps),
        "plain_pytorch_tokens_per_s": tokens / statistics.median(plain_steps),
    }
    result["ratio"] = result["mtnlg_fit_tokens_per_s"] / result["plain_pytorch_tokens_per_s"]
    print(
        f"framework overhead ({args.preset}, seq {args.seq_len}, batch {args.global_batch}, median of "
        f"{len(plain_steps)} steps each): mtnlg fit {result['mtnlg_fit_tokens_per_s']:,.0f} tokens/s | plain "
        f"PyTorch {result['plain_pytorch_tokens_per_s']:,.0f} tokens/s | ratio {result['ratio']:.3f} "
        f"(target >= 0.95)"
    )
    write_result(args.json, result)
    return 0 if math.isfinite(result["ratio"]) else 1


if __name__ == "__main__":
    sys.exit(main())
