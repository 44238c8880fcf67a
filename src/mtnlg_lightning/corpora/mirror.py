"""A run's work folder carried through object storage, for Ray workers that share no file system with the driver.

The curation stages read and write work files by path (memory-mapped signatures, plain copies read by byte offset),
so every task needs the files of the stages before it on a local disk. With an output URL and ``--engine ray``, the
driver's work folder (the output's scratch folder) has a twin under the output's hidden prefix ``.mtnlg-work/``:

* before each stage's tasks are sent, the driver uploads its files that changed and sends the list of every file
  it holds, each with its size and modification time (the *manifest*);
* a worker process keeps its own copy of the folder: it brings the copy to the manifest (downloads what differs,
  deletes what the driver no longer holds), runs its tasks on it, with every path under the driver's folder
  rewritten to its own, then uploads the files its tasks wrote and returns their names with its results;
* the driver downloads those files as the results come in.

The driver is the one authority on which files exist, so a stale object in the store is never read; files are only
ever written whole (atomic renames), so a copy is never half a file. Each worker process holds a full copy of the
work files its stages may read (the signatures, the plain copies of the inputs): the price of needing no shared
file system.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from dataclasses import dataclass
from typing import Any

import mtnlg_lightning.corpora.storage as storage

MIRROR_PREFIX = ".mtnlg-work"
Manifest = dict[str, tuple[int, int]]  # relative path -> (size, mtime_ns)


def _is_temporary(name: str) -> bool:
    """An atomic write's temp file (``.NAME.xxxx.tmp``): never a finished file."""
    return name.startswith(".") and name.endswith(".tmp")


def scan(root: str) -> Manifest:
    """Every finished file below ``root`` with its size and modification time."""
    found: Manifest = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if _is_temporary(name):
                continue
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            found[os.path.relpath(path, root).replace(os.sep, "/")] = (st.st_size, st.st_mtime_ns)
    return found


@dataclass(frozen=True)
class WorkMirror:
    """The driver's folder ``local_root`` and its twin in the store, ``remote_root``."""

    local_root: str
    remote_root: str

    def remote(self, rel: str) -> str:
        return f"{self.remote_root}/{rel}"

    def fetch(self, root: str, rel: str, size_mtime: tuple[int, int]) -> None:
        """File ``rel`` from the store into ``root``, with the modification time the manifest gives it."""
        dest = os.path.join(root, *rel.split("/"))
        storage.download(self.remote(rel), dest)
        os.utime(dest, ns=(size_mtime[1], size_mtime[1]))

    # -- a worker process ------------------------------------------------------------------------------------
    def worker_root(self) -> str:
        """This process's copy of the folder; a copy of another run's folder, if any, is removed (one at a time)."""
        base = os.path.join(storage.cache_root(), "ray-mirror", str(os.getpid()))
        key = hashlib.sha256(self.local_root.encode()).hexdigest()[:16]
        if os.path.isdir(base):
            for other in os.listdir(base):
                if other != key:
                    shutil.rmtree(os.path.join(base, other), ignore_errors=True)
        return os.path.join(base, key)

    def sync(self, root: str, manifest: Manifest) -> Manifest:
        """Bring ``root`` to ``manifest``; returns what is there afterwards."""
        here = scan(root)
        for rel in here.keys() - manifest.keys():
            os.unlink(os.path.join(root, *rel.split("/")))
        for rel, state in manifest.items():
            if here.get(rel) != state:
                self.fetch(root, rel, state)
        return dict(manifest)

    def upload_new(self, root: str, before: Manifest) -> list[tuple[str, int, int]]:
        """Upload the files below ``root`` that are new or changed since ``before``; returns them."""
        written = []
        for rel, state in sorted(scan(root).items()):
            if before.get(rel) != state:
                storage.upload(os.path.join(root, *rel.split("/")), self.remote(rel))
                written.append((rel, *state))
        return written


class MirrorDriver:
    """The driver's side: uploads its changed files before a stage, downloads the files the workers wrote."""

    def __init__(self, mirror: WorkMirror):
        self.mirror = mirror
        self.in_store: Manifest = {}  # what the store holds of the driver's files, as far as this run knows

    def publish(self) -> Manifest:
        """Upload the driver's new and changed files; the manifest the workers bring their copies to."""
        here = scan(self.mirror.local_root)
        for rel, state in sorted(here.items()):
            if self.in_store.get(rel) != state:
                storage.upload(os.path.join(self.mirror.local_root, *rel.split("/")), self.mirror.remote(rel))
                self.in_store[rel] = state
        return here

    def receive(self, written: list[tuple[str, int, int]]) -> None:
        """Download the files a worker wrote (and uploaded) into the driver's folder."""
        for rel, size, mtime in written:
            self.mirror.fetch(self.mirror.local_root, rel, (size, mtime))
            self.in_store[rel] = (size, mtime)

    def clear(self) -> None:
        """Remove the twin from the store (the run is committed, or failed on bad input)."""
        storage.remove(self.mirror.remote_root, recursive=True)


def relocate(value: Any, old: str, new: str) -> Any:
    """``value`` with every path below the folder ``old`` rewritten below ``new``: strings, and the strings inside
    tuples, lists, dicts and dataclasses (a stage's context, a task's item); anything else is left as it is."""
    if isinstance(value, str):
        if value == old:
            return new
        return new + value[len(old) :] if value.startswith(old + os.sep) else value
    if isinstance(value, tuple | list):
        items = [relocate(v, old, new) for v in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict):
        return {k: relocate(v, old, new) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: relocate(getattr(value, f.name), old, new) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    return value
