"""One evaluation, in any layout: check the arguments, score the task (or harness tasks) on this rank's part of the
model, report on rank 0. `mtnlg-eval` (`evaluation/cli.py`) runs it through `inference.runs.run`.
"""

from __future__ import annotations

import os
import time

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation import tasks
from mtnlg_lightning.extras import require_extra
from mtnlg_lightning.inference.load import resolve_tokenizer
from mtnlg_lightning.inference.scoring import Scorer
from mtnlg_lightning.outputs import check_input_file, check_output, write_json


def check_args(args) -> None:
    """Every check of the flags and task files, before the model is read (one line each)."""
    if args.limit is not None and args.limit < 1 or args.stride is not None and args.stride < 1:
        raise MTNLGError("--limit and --stride must be at least 1")
    if args.output:
        check_output(args.output, [args.checkpoint, args.data, args.fewshot_data, args.tokenizer], replaces_dir=False)
        if os.path.isdir(args.output):
            raise MTNLGError(f"--output {args.output} is a directory; name a JSON file")
    if args.harness_tasks:
        require_extra("eval", "--harness-tasks")
        return
    try:
        tasks.check_task(args.task)
    except MTNLGError as error:
        raise MTNLGError(f"{error} (or use --harness-tasks)") from None
    if not args.data:
        raise MTNLGError(f"--task {args.task} needs --data FILE")
    for path in (args.data, args.fewshot_data):
        if path:
            check_input_file(path)
    if any(k < 0 for k in args.shots) or args.batch_size < 1:
        raise MTNLGError("--shots must be >= 0 and --batch-size >= 1")


def evaluate(args, model, tokenizer) -> dict:
    """{task: {setting: metrics}} of `--task` (through the task registry) or of `--harness-tasks` (through the
    harness adapter; empty on the data-parallel ranks other than 0 of a layout)."""
    if args.harness_tasks:
        from mtnlg_lightning.evaluation.harness import run_harness

        names = [t.strip() for t in args.harness_tasks.split(",") if t.strip()]
        found = run_harness(model, tokenizer, names, args.include_path, args.batch_size, limit=args.limit) or {}
        return {task: {"-": metrics} for task, metrics in found.items()}
    scorer = Scorer(model, args.batch_size, args.micro_batch_size, progress=not args.no_progress)
    a = args
    found = tasks.run_task(a.task, scorer, tokenizer, a.data, a.shots, a.fewshot_data, a.seed, a.limit, a.stride)
    return {a.task: found}


def run(args, model, plan) -> None:
    """Score, then (rank 0) print the table and write `--output`: results, settings, layout, time."""
    tokenizer = resolve_tokenizer(plan.source.tokenizer, args.tokenizer)
    started = time.perf_counter()
    results = evaluate(args, model, tokenizer)
    seconds = time.perf_counter() - started
    busy = busy_by_rank(model)
    if model.groups.rank == 0:
        settings = {k: v for k, v in vars(args).items() if k != "no_progress"}
        settings["layout"] = plan.layout.describe(plan.world_size)
        report(args, {"results": results, "settings": settings, "seconds": seconds, "stage_busy_fraction": busy})


def busy_by_rank(model) -> list[float]:
    """Per rank, the fraction of its forward passes' time spent computing its stages (the rest: waiting for a
    previous stage's activations or TP peers): how well the pipeline is kept fed."""
    times = [(model.times.busy, model.times.wall)]
    if model.layout.world_size > 1:
        import torch.distributed as dist

        times = [None] * dist.get_world_size()
        dist.all_gather_object(times, (model.times.busy, model.times.wall))
    return [round(busy / wall, 4) if wall else 0.0 for busy, wall in times]


def table(results: dict) -> str:
    lines = []
    for task, by_setting in results.items():
        for setting, metrics in by_setting.items():
            shown = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
            label = f"{task} {setting}-shot" if setting != "-" else task
            lines.append(f"{label:<24} {shown}")
    return "\n".join(lines)


def report(args, payload: dict) -> None:
    """The results table on stdout, and the whole payload written to `--output` (atomically) when asked."""
    print(table(payload["results"]))
    if args.output:
        write_json(args.output, payload)
        print(f"wrote {args.output}")
