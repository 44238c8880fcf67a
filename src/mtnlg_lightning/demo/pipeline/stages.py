"""Running one tool of the pipeline as its own process, with its output kept in a log file.

Each stage is the real command a user would type (a console script, its module run with this interpreter), so the
pipeline exercises exactly what the documentation shows.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mtnlg_lightning.errors import MTNLGError

# console script -> module it runs (pyproject's [project.scripts]); run as `python -m` so the pipeline needs no PATH
CONSOLE_SCRIPTS = {
    "mtnlg": "mtnlg_lightning.train.cli",
    "mtnlg-dedup": "mtnlg_lightning.curation.dedup_cli",
    "mtnlg-decontaminate": "mtnlg_lightning.curation.decontaminate_cli",
    "mtnlg-eval": "mtnlg_lightning.evaluation.cli",
    "mtnlg-export-hf": "mtnlg_lightning.interop.export_cli",
    "mtnlg-generate": "mtnlg_lightning.inference.generate_cli",
    "mtnlg-extract": "mtnlg_lightning.crawl.extract_cli",
    "mtnlg-quality": "mtnlg_lightning.crawl.quality_cli",
    "mtnlg-train-tokenizer": "mtnlg_lightning.data.tokenizer_cli",
    "mtnlg-preprocess": "mtnlg_lightning.data.preprocess_cli",
}


class StageFailed(MTNLGError):
    pass


@dataclass
class StageRecord:
    """What the report says about one stage: the command, its time, and counts in and out."""

    name: str
    command: str
    seconds: float = 0.0
    log: str | None = None
    documents_in: int | None = None
    documents_out: int | None = None
    bytes_in: int | None = None
    bytes_out: int | None = None
    tokens: int | None = None
    details: dict = field(default_factory=dict)

    def line(self) -> str:
        parts = [f"{self.name:<28}"]
        if self.documents_in is not None or self.documents_out is not None:
            parts.append(f"docs {_n(self.documents_in)} -> {_n(self.documents_out)}")
        if self.bytes_in is not None or self.bytes_out is not None:
            parts.append(f"bytes {_mb(self.bytes_in)} -> {_mb(self.bytes_out)}")
        if self.tokens is not None:
            parts.append(f"tokens {self.tokens:,}")
        parts.extend(str(v) for v in self.details.get("summary", []))
        parts.append(f"{self.seconds:.1f} s")
        return "  ".join(parts)


def _n(value) -> str:
    return "-" if value is None else f"{value:,}"


def _mb(value) -> str:
    return "-" if value is None else f"{value / 1e6:.2f} MB"


def tool_argv(tool: str, *args: str) -> list[str]:
    """`mtnlg-dedup a b` -> [python, -m, mtnlg_lightning.curation.dedup_cli, a, b]."""
    return [sys.executable, "-m", CONSOLE_SCRIPTS[tool], *args]


def shown(tool: str, args: list[str], cwd: Path) -> str:
    """The command as a user would type it, paths relative to the working directory where they lie below it."""
    words = [os.path.relpath(a, cwd) if os.path.isabs(a) and a.startswith(str(cwd) + os.sep) else a for a in args]
    return " ".join([tool, shlex.join(words)])


def run_tool(record: StageRecord, tool: str, args: list[str], log_dir: Path, index: int, cwd: Path) -> str:
    """Run the tool, its stdout+stderr to `log_dir/NN-name.log`; return its stdout. A failure raises StageFailed
    with the last lines of the log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{index:02d}-{record.name}.log"
    record.command, record.log = shown(tool, args, cwd), str(log)
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "HF_HUB_OFFLINE": "1"}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        f.write(f"$ {record.command}\n")
        f.flush()
        proc = subprocess.run(
            tool_argv(tool, *args), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=f, text=True, check=False
        )
        f.write(proc.stdout)
    record.seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-8:]
        raise StageFailed(
            f"stage {record.name} failed (exit {proc.returncode}): {record.command}\n  "
            + "\n  ".join(tail)
            + f"\n  (whole log: {log})"
        )
    return proc.stdout
