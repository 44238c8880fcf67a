"""The paper's task table in one command: `mtnlg-eval --suite mtnlg` (or `--suite FILE.yaml`), in any layout.

A suite is a YAML file (`evaluation/suites/*.yaml` ship with the package) of rows: an lm-evaluation-harness task
(`harness:`, through the adapter of `evaluation.harness`) or one of mtnlg-eval's own tasks (`native:`, reading a
local file), each at its numbers of shots, with the metric the table shows. The harness runs once per number of
shots over the rows that have it (`num_fewshot`; its own seeded draw of the examples, as `lm_eval` on the command
line). The table has the paper's shape: a row per task, columns zero-, one- and few-shot (the largest other k), as
markdown and JSON (`--table STEM`: STEM.md and STEM.json).

A suite file (YAML): `name` (optional; default the file's stem), `include_path` (optional: a folder of local harness
task YAMLs, relative to the file) and `tasks`, a list of rows, each with `row` (the table's name of the task), `group`
(optional), `metric` (the metric the table shows), `shots` (a list of numbers of in-context examples) and either
`harness: TASK` or `native: lambada|hans` with `data: FILE` (relative to the file; or `--task-data ROW=FILE`).
The table's JSON: {"suite", "file", "columns": ["zero-shot", "one-shot", "few-shot"], "rows": [{"task", "group",
"metric", "harness" or "native", "zero_shot", "one_shot", "few_shot", "few_shot_k"}]} (null: not run); `--output`
holds every metric of every row and number of shots under "results" and the same rows under "table".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation import tasks
from mtnlg_lightning.evaluation.harness import run_harness, task_manager
from mtnlg_lightning.outputs import atomic_write, check_input_file, write_json

SUITES = Path(__file__).with_name("suites")
COLUMNS = ("zero-shot", "one-shot", "few-shot")


@dataclass(frozen=True)
class Row:
    row: str  # the paper's name of the task (LAMBADA, RACE-h, ...)
    group: str  # completion prediction, reading comprehension, ...
    metric: str
    shots: tuple[int, ...]
    harness: str | None = None  # an lm-evaluation-harness task name
    native: str | None = None  # or one of mtnlg-eval's tasks, with its file
    data: str | None = None

    @property
    def task(self) -> str:
        return self.harness or self.native

    @property
    def few_shot(self) -> int | None:
        """The k of the few-shot column: the largest number of shots above 1."""
        return max((k for k in self.shots if k > 1), default=None)

    @property
    def columns(self) -> tuple[int | None, int | None, int | None]:
        """The numbers of shots of the table's zero-, one- and few-shot columns (None: not run)."""
        return (0 if 0 in self.shots else None, 1 if 1 in self.shots else None, self.few_shot)


@dataclass
class Suite:
    name: str
    path: Path
    rows: list[Row]
    include_path: str | None = None


def shipped() -> list[str]:
    return sorted(p.stem for p in SUITES.glob("*.yaml"))


def suite_path(spec: str) -> Path:
    """A shipped suite's file by name, or the YAML file `spec` names (one line when it is neither)."""
    if (SUITES / f"{spec}.yaml").is_file():
        return SUITES / f"{spec}.yaml"
    if spec.endswith((".yaml", ".yml")) or Path(spec).exists():
        check_input_file(spec)
        return Path(spec)
    raise MTNLGError(f"unknown suite {spec!r}; the shipped suites are {', '.join(shipped())} (or name a YAML file)")


def parse_row(path: Path, number: int, entry) -> Row:
    where = f"{path}: task {number}"
    if not isinstance(entry, dict):
        raise MTNLGError(f"{where}: expected a mapping with row, metric, shots and harness or native")
    if ("harness" in entry) == ("native" in entry):
        raise MTNLGError(f"{where}: name exactly one of harness (an lm-eval task) or native ({', '.join(tasks.TASKS)})")
    missing = [k for k in ("row", "metric", "shots") if k not in entry]
    if missing:
        raise MTNLGError(f"{where}: missing {', '.join(missing)}")
    shots = entry["shots"]
    if not isinstance(shots, list) or not shots or not all(isinstance(k, int) and k >= 0 for k in shots):
        raise MTNLGError(f"{where} ({entry['row']}): shots must be a non-empty list of whole numbers >= 0")
    native = entry.get("native")
    if native is not None and not tasks.check_task(native).fields:
        raise MTNLGError(f"{where}: native task {native!r} takes no shots; a suite row needs lambada or hans")
    data = entry.get("data")
    if data is not None:
        data = str((path.parent / data).resolve())
    return Row(
        str(entry["row"]), str(entry.get("group", "")), str(entry["metric"]), tuple(shots),
        entry.get("harness"), native, data,
    )  # fmt: skip


def read_suite(spec: str, task_data: list[str] | None = None, include_path: str | None = None) -> Suite:
    """The suite `spec` names, its native rows' files given (`task_data`: ROW=FILE overrides), checked."""
    path = suite_path(spec)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise MTNLGError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("tasks"), list) or not data["tasks"]:
        raise MTNLGError(f"{path}: a suite is a mapping with a non-empty list under tasks")
    rows = [parse_row(path, i, entry) for i, entry in enumerate(data["tasks"], start=1)]
    overrides = {}
    for item in task_data or []:
        name, sep, file = item.partition("=")
        if not sep or name not in {r.row for r in rows if r.native}:
            natives = ", ".join(r.row for r in rows if r.native) or "none"
            raise MTNLGError(f"--task-data {item}: expected ROW=FILE with ROW a native row of the suite ({natives})")
        overrides[name] = file
    resolved = []
    for row in rows:
        if row.native:
            file = overrides.get(row.row, row.data)
            if file is None:
                raise MTNLGError(
                    f"suite {path.stem}: {row.row} is read from a local file: pass --task-data {row.row}=FILE"
                )
            check_input_file(file)
            row = Row(row.row, row.group, row.metric, row.shots, None, row.native, file)
        resolved.append(row)
    local = data.get("include_path")
    if local is not None:
        local = str((path.parent / local).resolve())
    return Suite(str(data.get("name", path.stem)), path, resolved, include_path or local)


def run_suite(suite: Suite, model, tokenizer, scorer, batch_size: int, seed: int, limit: int | None) -> dict:
    """{row: {k: metrics}} for every row and number of shots (rank 0 of each replica; the harness gathers over the
    data-parallel replicas, so the other replicas' ranks get None from it and return what they have)."""
    results: dict[str, dict] = {row.row: {} for row in suite.rows}
    harness_rows = [row for row in suite.rows if row.harness]
    if harness_rows:
        manager = task_manager(sorted({row.harness for row in harness_rows}), suite.include_path)
        for k in sorted({k for row in harness_rows for k in row.shots}):
            rows = [row for row in harness_rows if k in row.shots]
            names = list(dict.fromkeys(row.harness for row in rows))
            found = run_harness(model, tokenizer, names, None, batch_size, manager, num_fewshot=k, limit=limit) or {}
            for row in rows:
                if row.harness in found:
                    results[row.row][str(k)] = found[row.harness]
    for row in suite.rows:
        if row.native:
            found = tasks.run_task(row.native, scorer, tokenizer, row.data, list(row.shots), None, seed, limit)
            results[row.row] = {str(k): metrics for k, metrics in found.items()}
    return results


def table_rows(suite: Suite, results: dict) -> list[dict]:
    """The paper's shape: per row the metric at 0, 1 and few (k) shots (None where not run or not reported)."""
    out = []
    for row in suite.rows:
        found = results.get(row.row, {})
        cells = [found.get(str(k), {}).get(row.metric) if k is not None else None for k in row.columns]
        entry = {"task": row.row, "group": row.group, "metric": row.metric}
        entry |= {"harness": row.harness} if row.harness else {"native": row.native}
        entry |= dict(zip(("zero_shot", "one_shot", "few_shot"), cells, strict=True)) | {"few_shot_k": row.few_shot}
        out.append(entry)
    return out


def markdown(suite: Suite, rows: list[dict]) -> str:
    def shown(value):
        return "-" if value is None else f"{value:.4f}"

    lines = [
        f"suite {suite.name} ({suite.path})",
        "",
        "| task | group | lm-eval / native task | metric | zero-shot | one-shot | few-shot | k |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [r["task"], r["group"], r.get("harness") or f"{r['native']} (native)", r["metric"]]
        cells += [shown(r["zero_shot"]), shown(r["one_shot"]), shown(r["few_shot"]), str(r["few_shot_k"] or "-")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_paths(stem: str) -> tuple[Path, Path]:
    """(markdown, JSON) of `--table STEM` (a .md or .json ending of STEM is dropped first)."""
    base = Path(stem)
    if base.suffix in (".md", ".json"):
        base = base.with_suffix("")
    return Path(f"{base}.md"), Path(f"{base}.json")


def write_table(stem: str, suite: Suite, rows: list[dict]) -> list[Path]:
    md, js = table_paths(stem)
    md.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(md, "w") as f:
        f.write(markdown(suite, rows) + "\n")
    write_json(js, {"suite": suite.name, "file": str(suite.path), "columns": list(COLUMNS), "rows": rows})
    return [md, js]


def describe(suite: Suite) -> dict:
    return {"name": suite.name, "file": str(suite.path), "rows": [asdict(r) for r in suite.rows]}
