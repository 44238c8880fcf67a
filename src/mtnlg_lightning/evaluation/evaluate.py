"""One evaluation, in any layout: check the arguments, score the task (a suite, the bias study, harness tasks) on
this rank's part of the model, report on rank 0. `mtnlg-eval` (`evaluation/cli.py`) runs it through
`inference.runs.run`.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation import tasks
from mtnlg_lightning.evaluation.bias.plot import plot_study
from mtnlg_lightning.evaluation.bias.study import BIAS_TASKS, SAMPLED, check_study, run_study
from mtnlg_lightning.evaluation.bias.tables import study_table
from mtnlg_lightning.evaluation.harness import run_harness
from mtnlg_lightning.evaluation.suite import markdown, read_suite, run_suite, table_paths, table_rows, write_table
from mtnlg_lightning.extras import require_extra
from mtnlg_lightning.inference.load import resolve_tokenizer
from mtnlg_lightning.inference.scoring import Scorer
from mtnlg_lightning.outputs import check_input_file, check_output, write_json


def is_study(args) -> bool:
    """The run is the bias study (one or more of its tasks)."""
    return bool(args.task) and any(t in BIAS_TASKS for t in args.task)


def samples(args) -> bool:
    """The run samples continuations (the model is then loaded for decoding: no sequence parallelism)."""
    return bool(args.task) and any(t in SAMPLED for t in args.task)


def check_args(args) -> None:
    """Every check of the flags and task files, before the model is read (one line each)."""
    if args.limit is not None and args.limit < 1 or args.stride is not None and args.stride < 1:
        raise MTNLGError("--limit and --stride must be at least 1")
    if args.batch_size < 1:
        raise MTNLGError("--batch-size must be >= 1")
    inputs = [args.checkpoint, args.data, args.fewshot_data, args.tokenizer]
    inputs += [item.partition("=")[2] for item in args.task_data or []]
    outputs = [("--output", args.output), ("--plot", args.plot)]
    outputs += [("--table", path) for path in (table_paths(args.table) if args.table else [])]
    for flag, path in outputs:
        if path:
            check_output(path, inputs, replaces_dir=False)
            if os.path.isdir(path):
                raise MTNLGError(f"{flag} {path} is a directory; name a file")
    if sum(map(bool, (args.task, args.harness_tasks, args.suite))) > 1:
        raise MTNLGError("name one of --task, --harness-tasks or --suite per run")
    if args.table and not args.suite:
        raise MTNLGError("--table writes a suite's table: use it with --suite")
    if args.plot and not is_study(args):
        raise MTNLGError(f"--plot draws the bias study: use it with --task {' / '.join(BIAS_TASKS)}")
    if args.harness_tasks:
        require_extra("eval", "--harness-tasks")
        return
    if args.suite:
        found = read_suite(args.suite, args.task_data, args.include_path)
        if any(row.harness for row in found.rows):
            require_extra("eval", f"--suite {args.suite} (its lm-evaluation-harness tasks)")
        return
    for name in args.task or [None]:
        if name not in tasks.TASKS and name not in BIAS_TASKS:
            known = ", ".join([*tasks.TASKS, *BIAS_TASKS])
            raise MTNLGError(f"unknown task {name!r}; the known tasks are {known} (or use --harness-tasks or --suite)")
    if is_study(args) or len(args.task) > 1:
        check_study(args, args.task)
        return
    if not args.data:
        raise MTNLGError(f"--task {args.task[0]} needs --data FILE")
    for path in (args.data, args.fewshot_data):
        if path:
            check_input_file(path)
    if any(k < 0 for k in args.shots):
        raise MTNLGError("--shots must be >= 0")


def evaluate(args, model, tokenizer) -> dict:
    """{task: {setting: metrics}} of `--task` (through the task registry), of `--suite` (a row per task) or of
    `--harness-tasks` (through the harness adapter; empty on the data-parallel ranks other than 0 of a layout);
    {task: result} of the bias study (empty on ranks other than 0)."""
    a = args
    scorer = Scorer(model, a.batch_size, a.micro_batch_size, progress=not a.no_progress)
    if a.harness_tasks:
        names = [t.strip() for t in a.harness_tasks.split(",") if t.strip()]
        found = run_harness(model, tokenizer, names, a.include_path, a.batch_size, limit=a.limit) or {}
        return {task: {"-": metrics} for task, metrics in found.items()}
    if a.suite:
        found = read_suite(a.suite, a.task_data, a.include_path)
        return run_suite(found, model, tokenizer, scorer, a.batch_size, a.seed, a.limit)
    if is_study(a):
        return run_study(a, model, tokenizer, scorer, a.task)
    name = a.task[0]
    return {name: tasks.run_task(name, scorer, tokenizer, a.data, a.shots, a.fewshot_data, a.seed, a.limit, a.stride)}


def run(args, model, plan) -> None:
    """Score, then (rank 0) print the table and write `--output`: results, settings, layout, time."""
    tokenizer = resolve_tokenizer(plan.source.tokenizer, args.tokenizer)
    started = time.perf_counter()
    results = evaluate(args, model, tokenizer)
    seconds = time.perf_counter() - started
    busy = busy_by_rank(model)
    if model.groups.rank == 0:
        settings = {k: v for k, v in vars(args).items() if k != "no_progress"}
        settings["layout"] = plan.strategy.describe(plan.world_size)
        report(args, {"results": results, "settings": settings, "seconds": seconds, "stage_busy_fraction": busy})


def busy_by_rank(model) -> list[float]:
    """Per rank, the fraction of its forward passes' time spent computing its stages (the rest: waiting for a
    previous stage's activations or TP peers): how well the pipeline is kept fed."""
    times = [(model.times.busy, model.times.wall)]
    if model.layout.world_size > 1:
        times = [None] * dist.get_world_size()
        dist.all_gather_object(times, (model.times.busy, model.times.wall))
    return [round(busy / wall, 4) if wall else 0.0 for busy, wall in times]


def table(results: dict) -> str:
    """One line per task and setting. Floats to 6 significant digits: what an fp32 reduction reproduces in every
    layout (a layout sums in another order, ~1e-7 relative apart), so the printed table does not depend on the
    layout; `--output` keeps the full values."""
    lines = []
    for task, by_setting in results.items():
        for setting, metrics in by_setting.items():
            shown = "  ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
            label = f"{task} {setting}-shot" if setting != "-" else task
            lines.append(f"{label:<24} {shown}")
    return "\n".join(lines)


def report(args, payload: dict) -> None:
    """The results table on stdout (the bias study's and a suite's as markdown), the whole payload written to
    `--output` (atomically) when asked, and the suite's table (`--table`) or the study's plot (`--plot`)."""
    results = payload["results"]
    written = []
    if is_study(args):
        print(study_table(results))
        if args.plot:
            written.append(plot_study(results, args.plot))
    elif args.suite:
        found = read_suite(args.suite, args.task_data, args.include_path)
        rows = table_rows(found, results)
        payload["table"] = rows
        print(table(results) + "\n\n" + markdown(found, rows))
        if args.table:
            written += write_table(args.table, found, rows)
    else:
        print(table(results))
    if args.output:
        write_json(args.output, payload)
        written.append(args.output)
    for path in written:
        print(f"wrote {path}")
