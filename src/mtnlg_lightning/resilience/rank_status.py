"""Each rank's last known state, in a small file on its own node: the phase it was in, its step, when it last made
progress. The watchdog thread rewrites it when something changed (at most once a poll), so it outlives a kill -9;
the launcher reads it to say where a rank failed, and a restarted run to say what the fault cost.

The folder is node-local (a temporary folder of the launcher, or of torchrun's run logs under plain torchrun): one
file per attempt and local rank, `attempt<N>_rank<L>.json`, so a restarted rank never overwrites what the attempt
before it left.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mtnlg_lightning.outputs import write_json

STATUS_DIR_ENV = "MTNLG_STATUS_DIR"  # set by resilience/launch.py; else derived from torchrun's error-file folder


def status_dir() -> Path | None:
    """This node's folder of rank statuses, or None outside torchrun."""
    if os.environ.get(STATUS_DIR_ENV):
        return Path(os.environ[STATUS_DIR_ENV])
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if error_file and error_file != os.devnull:
        return Path(error_file).parents[2] / "mtnlg_status"  # <run logs>/attempt_<k>/<local rank>/error.json
    return None


def status_path(directory: Path, attempt: int, local_rank: int) -> Path:
    return directory / f"attempt{attempt}_rank{local_rank}.json"


def write_status(directory: Path, attempt: int, local_rank: int, status: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    write_json(status_path(directory, attempt, local_rank), status, indent=None)


def read_statuses(directory: Path | None, attempt: int) -> list[dict]:
    """Every local rank's last status in `attempt` (ranks that never wrote one are missing)."""
    if directory is None or not directory.is_dir():
        return []
    statuses = []
    for path in sorted(directory.glob(f"attempt{attempt}_rank*.json")):
        try:
            statuses.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue  # being replaced this instant, or left half-written by a full disk: not worth failing for
    return statuses
