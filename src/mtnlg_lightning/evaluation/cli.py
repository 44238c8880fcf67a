"""`mtnlg-eval`: LAMBADA, HANS, perplexity, the bias study, the paper's task table (or any lm-evaluation-harness
task) on a checkpoint or HF directory.

mtnlg-eval --checkpoint CKPT --task lambada --data lambada.jsonl --shots 0 1 15 --output results.json
mtnlg-eval --checkpoint CKPT --task hans --data hans.jsonl --shots 0 4 16
mtnlg-eval --checkpoint CKPT --task perplexity --data valid.txt --stride 512
mtnlg-eval --checkpoint CKPT --task gender-occupation cooccurrence sentiment --plot bias.png --output bias.json
mtnlg-eval --checkpoint CKPT --suite mtnlg --task-data HANS=heuristics_evaluation_set.txt --table mtnlg_table
mtnlg-eval --checkpoint CKPT --harness-tasks lambada_openai,hellaswag [--include-path DIR]
mtnlg-eval --checkpoint CKPT --strategy configs/strategy/tp2_pp2_dp2.yaml --devices 8 --task lambada ...
"""

from __future__ import annotations

import argparse
import sys

from mtnlg_lightning.evaluation import evaluate, tasks
from mtnlg_lightning.evaluation.bias.study import BIAS_TASKS
from mtnlg_lightning.inference.runs import run
from mtnlg_lightning.shipped_configs import config_argument


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtnlg-eval",
        description=__doc__.split("\n\n")[0] + " Metrics use lm-evaluation-harness' names and definitions.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a project checkpoint (folder or .ckpt file) or a Hugging Face model directory",
    )
    p.add_argument(
        "--task",
        nargs="+",
        help=f"one of {', '.join(tasks.TASKS)}; or any of the bias study's {', '.join(BIAS_TASKS)} "
        "(together in one run: cooccurrence and sentiment read the same continuations); or use --harness-tasks or "
        "--suite",
    )
    p.add_argument(
        "--data",
        help="lambada: jsonl {text}; hans: jsonl {sentence1, sentence2, gold_label, heuristic}; "
        "perplexity: a .jsonl {text} file or a text file (one document); the bias study: its word lists and "
        "prompts as JSON (default: the shipped evaluation/bias/study.json)",
    )
    p.add_argument("--shots", type=int, nargs="+", default=[0], help="numbers of in-context examples (lambada, hans)")
    p.add_argument("--fewshot-data", help="draw in-context examples from this file (default: other items of --data)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the in-context example draw and of sampling")
    p.add_argument("--stride", type=int, default=None, help="perplexity: new tokens per window (default: positions)")
    p.add_argument(
        "--batch-size", type=int, default=16, help="sequences per forward pass (the bias study: decoded together)"
    )
    p.add_argument("--output", help="write the results and settings as JSON here (atomically)")
    p.add_argument("--harness-tasks", help="comma-separated lm-evaluation-harness tasks, run through our model")
    p.add_argument("--include-path", help="a directory of local harness task YAML files")
    p.add_argument(
        "--suite",
        help="run a suite of tasks at their numbers of shots and write the paper's table: a shipped suite's name "
        "(mtnlg: MT-NLG's eight tasks) or a suite YAML file",
    )
    p.add_argument(
        "--task-data",
        action="append",
        metavar="ROW=FILE",
        help="the file of a suite's native row (e.g. HANS=heuristics_evaluation_set.txt); repeatable",
    )
    p.add_argument("--table", metavar="STEM", help="--suite: write the table as STEM.md and STEM.json")
    p.add_argument("--plot", metavar="PATH", help="the bias study: draw its results into this PNG ([plot] extra)")
    study = p.add_argument_group("sampling of the bias study (cooccurrence, sentiment; the paper's by default)")
    study.add_argument("--num-continuations", type=int, default=800, help="continuations sampled per prompt")
    study.add_argument("--max-new-tokens", type=int, default=50, help="tokens per continuation (at most)")
    study.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (> 0)")
    study.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling: keep this probability mass")
    study.add_argument("--top-k", type=int, default=None, help="keep only the k likeliest tokens (default: all)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N items (quick checks)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or directory, if the checkpoint names none")
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="auto: bf16 on GPU")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument(
        "--strategy",
        type=config_argument("strategy"),
        help="evaluate in a layout: a strategy YAML of `mtnlg fit` (configs/strategy/*.yaml: TP, PP, schedule, "
        "sequence parallelism; DP = devices / (TP x PP); ZeRO settings do not apply). Each rank reads only its "
        "slice of the model; the printed results are the same in every layout",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="local ranks to start (as `mtnlg fit --trainer.devices N`); under torchrun/srun, the launcher's world",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="sequences per micro-batch through the pipeline stages (default: batch size / PP)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return run(
        "mtnlg-eval",
        "mtnlg_lightning.evaluation.cli",
        args,
        argv,
        evaluate.check_args,
        lambda model, plan: evaluate.run(args, model, plan),
        decoding=evaluate.samples(args),
    )


if __name__ == "__main__":
    sys.exit(main())
