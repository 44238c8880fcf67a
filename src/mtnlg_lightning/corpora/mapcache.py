"""Memory maps of a run's ``.npy`` work files, kept open between the tasks that a process runs."""

from __future__ import annotations

import os

import numpy as np

# Memory maps of work files, kept open between the tasks of a run: opening a ``.npy`` map (header parse, mmap) costs
# ~0.1 ms, and a task touches one file per shard. Keyed by (path, inode, mtime, size): work files are only ever
# replaced whole (atomic rename: a new inode), never changed in place, so a hit is always the current file. Cleared
# by the engines when a run ends (pool workers exit; the driver and Ray workers clear), so no map of a removed
# work directory stays open.
_MAPS: dict[tuple, np.ndarray] = {}
_MAPS_MAX = 1024


def load_map(path: str) -> np.ndarray:
    """``np.load(path, mmap_mode="r")``, reusing an open map of the same file."""
    st = os.stat(path)
    key = (path, st.st_ino, st.st_mtime_ns, st.st_size)
    m = _MAPS.get(key)
    if m is None:
        if len(_MAPS) >= _MAPS_MAX:
            _MAPS.clear()
        m = _MAPS[key] = np.load(path, mmap_mode="r")
    return m


def clear_maps() -> None:
    _MAPS.clear()
