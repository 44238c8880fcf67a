"""Restarts that resume by themselves: a fresh rendezvous namespace per attempt, `ckpt_path=last` resolved to the
newest complete checkpoint wherever the run's checkpoint callbacks write, and one line saying what happened."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from mtnlg_lightning.checkpoint.commit import newest_complete
from mtnlg_lightning.checkpoint.format import read_manifest
from mtnlg_lightning.resilience import restart_record
from mtnlg_lightning.resilience.attempt import ATTEMPT_ID_ENV, RESTART_CAUSE_ENV, restart_cause, restart_count

__all__ = ["RESTART_CAUSE_ENV", "restart_cause", "restart_count"]  # their home is attempt.py; imported from here too


def process_group_store(timeout: timedelta) -> dict:
    """`init_process_group` arguments that give each torchrun attempt its own key namespace.

    torchrun (torch >= 2.4) shares its agent's TCPStore with the workers and keeps that store across restarts, without
    a per-attempt prefix. gloo's full-mesh connect publishes each rank's address under fixed keys, so a restarted rank
    can read the address of a peer from the previous attempt and fail with `connectFullMesh ... Connection refused`
    (reproduced: 2 ranks, one killed, the first restart failed this way). Prefixing the keys with the attempt makes
    every attempt start from an empty namespace: the launcher's id of the start where there is one (a restart for a
    node that joined keeps torchrun's restart count), else torchrun's restart count. Outside torchrun's shared
    store: nothing to do.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get(ATTEMPT_ID_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world_size = int(os.environ["WORLD_SIZE"])
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return {"store": dist.PrefixStore(f"/mtnlg/attempt_{attempt}", client)}


def checkpoint_dirs(trainer) -> list[Path]:
    """Every folder this run's checkpoints can be in: the checkpoint callbacks' `dirpath`s, the preemption folder
    (`default_root_dir/checkpoints`) and, for a callback without `dirpath`, the loggers' versioned folders (each
    restart would otherwise get a new, empty `version_N`)."""
    dirs = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    dirs.append(Path(trainer.default_root_dir) / "checkpoints")
    if any(getattr(cb, "dirpath", "") is None for cb in trainer.checkpoint_callbacks):
        for logger in trainer.loggers:
            if logger.save_dir is not None:
                dirs += sorted((Path(logger.save_dir) / str(logger.name or "")).glob("*/checkpoints"))
    unique = []
    for directory in dirs:
        if directory.resolve() not in {d.resolve() for d in unique}:
            unique.append(directory)
    return unique


def newest_checkpoint(directories: list[Path]) -> Path | None:
    """The complete checkpoint of the highest step over `directories` (newest by time between equal steps)."""
    best, best_key = None, None
    for directory in directories:
        path = newest_complete(directory)
        if path is None:
            continue
        key = (_step_of(path), (path / "manifest.json").stat().st_mtime)
        if best_key is None or key > best_key:
            best, best_key = path, key
    return best


def resolve_ckpt_path(trainer, ckpt_path: str | None) -> str | None:
    """`last` (and, on a restart, no path at all) becomes the newest complete checkpoint of the run, or None to
    start fresh. On a restart, an explicit path (where the first attempt started from) gives way to a newer
    checkpoint the run has written since. Lightning's own `last` takes the newest `last*.ckpt` by time, with no
    completeness check, from the callbacks' folders only."""
    restarted = restart_count() > 0
    if ckpt_path not in (None, "last") and not restarted:
        return ckpt_path
    if ckpt_path is None and not restarted:
        return None
    dirs = checkpoint_dirs(trainer)
    newest = newest_checkpoint(dirs)
    if ckpt_path not in (None, "last"):
        if newest is None or _step_of(newest) <= _step_of(Path(ckpt_path)):
            return ckpt_path
    if newest is None:
        rank_zero_info(f"ckpt_path=last: no complete checkpoint in {', '.join(map(str, dirs))}; starting from scratch")
        return None
    rank_zero_info(f"ckpt_path=last: resuming from {newest}")
    return str(newest)


def _step_of(path: Path) -> int:
    try:
        return int(read_manifest(path).get("global_step", -1))
    except Exception:  # noqa: BLE001 - not this format (a plain Lightning file): the load reports it
        return -1


def report_restart(trainer) -> None:
    """Rank 0 of a restarted group says what happened, once: `restart k: resumed from step N (cause); ...`, in the
    log and in `restarts.jsonl` beside the checkpoints (`restart_record.py`)."""
    restart_record.report_restart(trainer, checkpoint_dirs(trainer))
