"""Every inference check of one layout in one launch (launches are the expensive part on a small CPU machine).

    python tests/dist_inference_runs.py OUT_DIR --strategy configs/strategy/tp2.yaml --devices 2 \\
        --checkpoint single=CKPT --checkpoint tp2xpp2xdp2=CKPT --tokenizer TOK --cloze F --hans F --text F \\
        --task-dir DIR

Starts its ranks with the launcher `mtnlg-eval --devices` uses (or runs under torchrun). For each checkpoint, every
rank runs `mtnlg-eval --strategy` in-process for LAMBADA 0/3-shot, HANS, perplexity and a harness task (rank 0
writes OUT_DIR/NAME_TASK.json), then greedy generation of prompts of different lengths and seeded sampling twice;
rank 0 writes OUT_DIR/NAME_generation.json with the sampled tokens as every rank saw them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.evaluation.cli import main as eval_main
from mtnlg_lightning.inference.decode import generate_over_replicas
from mtnlg_lightning.inference.launch import launch_command, needs_launch, world_size_for
from mtnlg_lightning.inference.runs import load_planned, plan

PROMPTS = ["Return the", "The value of the argument is", "A", "If the file does not exist, the function raises"]
NEW_TOKENS = 10
SAMPLING = dict(temperature=0.9, top_k=40, seed=7)


def tasks(args) -> dict[str, list[str]]:
    return {
        "lambada": ["--task", "lambada", "--data", args.cloze, "--shots", "0", "3"],
        "hans": ["--task", "hans", "--data", args.hans, "--shots", "0", "2"],
        "perplexity": ["--task", "perplexity", "--data", args.text, "--stride", "32"],
        "harness": ["--harness-tasks", "cloze_lambada", "--include-path", args.task_dir],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--strategy", required=True)
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--checkpoint", action="append", required=True, help="NAME=PATH")
    for name in ("tokenizer", "cloze", "hans", "text", "task_dir"):
        ap.add_argument(f"--{name.replace('_', '-')}", required=True)
    args = ap.parse_args()
    world = world_size_for(args.devices)
    if needs_launch(world):
        return launch_command([sys.executable, __file__, *sys.argv[1:]], world)
    dist.init_process_group("gloo")
    out, rank = Path(args.out), dist.get_rank()
    tokenizer = Tokenizer(args.tokenizer)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    for spec in args.checkpoint:
        name, path = spec.split("=", 1)
        base = ["--checkpoint", path, "--tokenizer", args.tokenizer, "--no-progress", "--dtype", "fp32"]
        base += ["--strategy", args.strategy, "--batch-size", "8"]
        for task, argv in tasks(args).items():
            code = eval_main([*base, *argv, "--output", str(out / f"{name}_{task}.json")])
            assert code == 0, (name, task, code)
        model = load_planned(plan(path, args.strategy, None), "cpu", "fp32", decoding=True)
        greedy = generate_over_replicas(
            model, prompts, max_new_tokens=NEW_TOKENS, temperature=0.0, eos_id=tokenizer.eod_id
        )
        sampled = [
            generate_over_replicas(
                model, prompts, max_new_tokens=NEW_TOKENS, eos_id=tokenizer.eod_id, **SAMPLING
            ).tokens
            for _ in range(2)
        ]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, sampled)
        if rank == 0:
            record = {
                "greedy": greedy.tokens,
                "stop": greedy.stop,
                "sampled_by_rank": every,
                "busy_fraction": model.times.busy_fraction,
            }
            (out / f"{name}_generation.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
