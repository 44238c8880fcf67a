"""One evaluation run, whatever launched it: check the arguments, score the task (or harness tasks), report.

`mtnlg-eval` (`evaluation/cli.py`) parses the flags; a one-process run calls `run`, a layout's ranks (started by
`inference/runs.py`) call `check_args`, `evaluate` and `report` around their sharded model.
"""

from __future__ import annotations

import os
import time

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation import tasks
from mtnlg_lightning.evaluation.scoring import Scorer
from mtnlg_lightning.extras import require_extra
from mtnlg_lightning.outputs import check_input_file, check_output, write_json


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
