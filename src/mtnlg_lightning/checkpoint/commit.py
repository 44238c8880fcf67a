"""Crash-safe publication: a checkpoint is written under a hidden staging name and renamed into place only after
every rank's files and the manifest exist, so an interrupted save never damages or impersonates a checkpoint."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from mtnlg_lightning.checkpoint.format import MANIFEST, is_checkpoint, read_manifest
from mtnlg_lightning.outputs import replace_dir

STAGING_SUFFIX = ".incomplete"


def staging_path(final: Path) -> Path:
    return final.parent / f".{final.name}{STAGING_SUFFIX}"


def prepare_staging(final: Path) -> Path:
    """A fresh, empty staging folder for `final` (a leftover of an interrupted save is removed)."""
    staging = staging_path(final)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, final: Path) -> None:
    """Move a complete staging folder to its final name, replacing what was there (a file, a folder or a link)."""
    if not (staging / MANIFEST).is_file():
        raise RuntimeError(f"{staging} has no manifest: refusing to publish an incomplete checkpoint")
    replace_dir(staging, final)
    _fsync_dir(final.parent)


def link(target: Path, link_path: Path) -> None:
    """Point `link_path` at `target` (relative, in one rename): a reader sees the old link or the new, never none."""
    staging = link_path.parent / f".{link_path.name}.link{os.getpid()}"
    staging.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, link_path.parent), staging)
    if link_path.is_dir() and not link_path.is_symlink():
        shutil.rmtree(link_path)  # a copy that `save_last: true` wrote: a link cannot replace a folder in one rename
    os.replace(staging, link_path)
    _fsync_dir(link_path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def newest_complete(*directories: Path, max_step: int | None = None) -> Path | None:
    """The complete checkpoint of the highest step (at most `max_step`) in `directories` (links and staging folders
    are skipped; between equal steps the newest by modification time). The one search for "the checkpoint to go
    back to": restarts, `last` links and loss-spike rewinds all use it."""
    best, best_key = None, None
    for directory in map(Path, directories):
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            if path.name.startswith(".") or path.is_symlink() or not is_checkpoint(path):
                continue
            try:
                step = int(read_manifest(path).get("global_step", -1))
            except Exception:  # noqa: BLE001 - an unreadable manifest is not a candidate
                continue
            if max_step is not None and step > max_step:
                continue
            key = (step, (path / MANIFEST).stat().st_mtime)
            if best_key is None or key > best_key:
                best, best_key = path, key
    return best


def remove_checkpoint(path) -> None:
    """Lightning's removal of an earlier top-k / last checkpoint: only a checkpoint (a folder with a manifest, a
    `.ckpt` file) or a link is removed; anything else at that path is left, with a warning, never deleted."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
    elif path.is_dir() and is_checkpoint(path):
        shutil.rmtree(path, ignore_errors=True)
    elif path.is_file() and path.suffix == ".ckpt":
        path.unlink()
    elif path.exists():
        warnings.warn(f"not removing {path}: it is not a checkpoint", stacklevel=2)
