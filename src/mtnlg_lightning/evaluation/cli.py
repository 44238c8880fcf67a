"""`mtnlg-eval`: LAMBADA, HANS and perplexity (or any lm-evaluation-harness task) on a checkpoint or HF directory.

mtnlg-eval --checkpoint CKPT --task lambada --data lambada.jsonl --shots 0 1 15 --output results.json
mtnlg-eval --checkpoint CKPT --task hans --data hans.jsonl --shots 0 4 16
mtnlg-eval --checkpoint CKPT --task perplexity --data valid.txt --stride 512
mtnlg-eval --checkpoint CKPT --harness-tasks lambada_openai,hellaswag [--include-path DIR]
mtnlg-eval --checkpoint CKPT --strategy configs/strategy/tp2_pp2_dp2.yaml --devices 8 --task lambada ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation import tasks
from mtnlg_lightning.evaluation.scoring import Scorer
from mtnlg_lightning.extras import require_extra
from mtnlg_lightning.outputs import check_input_file, check_output, write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtnlg-eval",
        description=__doc__.split("\n\n")[0] + " Metrics use lm-evaluation-harness' names and definitions.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, help="a project checkpoint or a Hugging Face GPT-2 directory")
    p.add_argument("--task", help=f"one of {', '.join(tasks.TASKS)} (or use --harness-tasks)")
    p.add_argument(
        "--data",
        help="lambada: jsonl {text}; hans: jsonl {sentence1, sentence2, gold_label, heuristic}; "
        "perplexity: a .jsonl {text} file or a text file (one document)",
    )
    p.add_argument("--shots", type=int, nargs="+", default=[0], help="numbers of in-context examples (lambada, hans)")
    p.add_argument("--fewshot-data", help="draw in-context examples from this file (default: other items of --data)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the in-context example draw")
    p.add_argument("--stride", type=int, default=None, help="perplexity: new tokens per window (default: positions)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    p.add_argument("--output", help="write the results and settings as JSON here (atomically)")
    p.add_argument("--harness-tasks", help="comma-separated lm-evaluation-harness tasks, run through our model")
    p.add_argument("--include-path", help="a directory of local harness task YAML files")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N items (quick checks)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or directory, if the checkpoint names none")
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="auto: bf16 on GPU")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument(
        "--strategy",
        help="evaluate in a layout: a strategy YAML of `mtnlg fit` (configs/strategy/*.yaml: TP, PP, schedule, "
        "sequence parallelism; DP = devices / (TP x PP); ZeRO settings do not apply). Each rank reads only its "
        "slice of the checkpoint folder",
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
        help="with --strategy: sequences per micro-batch through the pipeline (default: batch size / PP)",
    )
    return p


def evaluate(args, model, tokenizer, make_scorer) -> dict:
    """{task: {setting: metrics}} of `--task` (scored by `make_scorer()`, through the task registry) or of
    `--harness-tasks` (through the harness adapter; empty on the data-parallel ranks other than 0 of a layout)."""
    if args.harness_tasks:
        from mtnlg_lightning.evaluation.harness import run_harness

        names = [t.strip() for t in args.harness_tasks.split(",") if t.strip()]
        found = run_harness(model, tokenizer, names, args.include_path, args.batch_size, limit=args.limit) or {}
        return {task: {"-": metrics} for task, metrics in found.items()}
    a = args
    found = tasks.run_task(a.task, make_scorer(), tokenizer, a.data, a.shots, a.fewshot_data, a.seed, a.limit, a.stride)
    return {a.task: found}


def check_args(args) -> None:
    if args.limit is not None and args.limit < 1 or args.stride is not None and args.stride < 1:
        raise MTNLGError("--limit and --stride must be at least 1")
    if args.output:
        check_output(args.output, [args.checkpoint, args.data, args.fewshot_data, args.tokenizer], replaces_dir=False)
        if os.path.isdir(args.output):
            raise MTNLGError(f"--output {args.output} is a directory; name a JSON file")
    if args.harness_tasks:
        require_extra("eval", "--harness-tasks")  # before the model is loaded
        return
    try:
        tasks.check_task(args.task)
    except MTNLGError as error:
        raise MTNLGError(f"{error} (or use --harness-tasks)") from None
    if not args.data:
        raise MTNLGError(f"--task {args.task} needs --data FILE")
    for path in (args.data, args.fewshot_data):  # before the model loads
        if path:
            check_input_file(path)
    if any(k < 0 for k in args.shots) or args.batch_size < 1:
        raise MTNLGError("--shots must be >= 0 and --batch-size >= 1")


def table(results: dict) -> str:
    lines = []
    for task, by_setting in results.items():
        for setting, metrics in by_setting.items():
            shown = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
            label = f"{task} {setting}-shot" if setting != "-" else task
            lines.append(f"{label:<24} {shown}")
    return "\n".join(lines)


def run(args) -> dict:
    from mtnlg_lightning.inference.load import load_model, pick_device, pick_dtype, resolve_tokenizer

    check_args(args)
    device = pick_device(args.device)
    model, state = load_model(args.checkpoint, device, pick_dtype(args.dtype, device))
    tokenizer = resolve_tokenizer(state.tokenizer, args.tokenizer)
    started = time.perf_counter()
    results = evaluate(args, model, tokenizer, lambda: Scorer(model, args.batch_size, progress=not args.no_progress))
    payload = {"results": results, "settings": settings_of(args), "seconds": time.perf_counter() - started}
    report(args, payload)
    return payload


def settings_of(args) -> dict:
    """The run's settings as the JSON output records them (display flags left out)."""
    return {k: v for k, v in vars(args).items() if k not in ("no_progress",)}


def report(args, payload: dict) -> None:
    """The results table on stdout, and the whole payload written to `--output` (atomically) when asked."""
    print(table(payload["results"]))
    if args.output:
        write_json(args.output, payload)
        print(f"wrote {args.output}")


def main(argv: list[str] | None = None) -> int:
    from mtnlg_lightning.inference.runs import command_main, run_eval

    return command_main("mtnlg-eval", build_parser(), run, run_eval, argv)


if __name__ == "__main__":
    sys.exit(main())
