"""Remote files read by ranged requests through a bounded local cache of fixed-size blocks.

Training reads an indexed dataset's tokens at random places; from object storage each read would be a request, and
copying the corpus first is what this avoids. A read asks for the blocks it spans: a block on local disk is read
from there, a missing one is fetched with one ranged request and kept. The blocks of every file share one bound
(``max_bytes``): before a block is written, the least recently used blocks are removed until it fits. Processes
(data-loader workers, ranks of a node) may share one cache folder: a block is written under a temporary name and
renamed, so a reader sees a whole block or none, and writers take turns (a lock file in the folder, held while
room is made and the block written, never while it is fetched), so the bound holds at every moment.

A block is named by the file's URL and version (ETag), so a changed remote file never serves stale bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.errors import MTNLGError

DEFAULT_BLOCK_BYTES = 4 << 20
BLOCK_SUFFIX = ".blk"
LOCK_NAME = ".writer.lock"
BLOCKS_IN_MEMORY = 4  # the last blocks read, kept in the process: consecutive samples mostly share a block


@dataclass
class BlockCache:
    """Blocks of remote files under ``directory``, at most ``max_bytes`` of them on disk."""

    directory: str
    max_bytes: int
    block_bytes: int = DEFAULT_BLOCK_BYTES
    _recent: OrderedDict = field(default_factory=OrderedDict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_bytes <= 0:
            raise MTNLGError(f"the block size must be positive, got {self.block_bytes}")
        if self.max_bytes < self.block_bytes:
            raise MTNLGError(
                f"a remote-data cache of {self.max_bytes} bytes cannot hold one block of {self.block_bytes}; "
                "give it more room"
            )
        os.makedirs(self.directory, exist_ok=True)

    def __getstate__(self) -> dict:  # a data-loader worker starts with an empty in-memory part
        return {**self.__dict__, "_recent": OrderedDict()}

    def read(self, url: str, version: str, size: int, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the remote file ``url`` (``size`` bytes at ``version``)."""
        end = min(end, size)
        if start >= end:
            return b""
        first, last = start // self.block_bytes, (end - 1) // self.block_bytes
        parts = [self._block(url, version, size, b) for b in range(first, last + 1)]
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        offset = first * self.block_bytes
        return data[start - offset : end - offset]

    def _block(self, url: str, version: str, size: int, index: int) -> bytes:
        key = self._name(url, version, index)
        data = self._recent.get(key)
        if data is not None:
            self._recent.move_to_end(key)
            return data
        path = os.path.join(self.directory, key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            with contextlib.suppress(OSError):
                os.utime(path)  # recently used: evicted last
        except FileNotFoundError:
            lo = index * self.block_bytes
            data = storage.read_bytes(url, lo, min(lo + self.block_bytes, size))
            self._store(path, data)
        self._recent[key] = data
        while len(self._recent) > BLOCKS_IN_MEMORY:
            self._recent.popitem(last=False)
        return data

    @staticmethod
    def _name(url: str, version: str, index: int) -> str:
        digest = hashlib.sha256(f"{url}@{version}".encode()).hexdigest()[:24]
        return f"{digest}-{index:09d}{BLOCK_SUFFIX}"

    def _store(self, path: str, data: bytes) -> None:
        with open(os.path.join(self.directory, LOCK_NAME), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            self.evict(self.max_bytes - len(data))
            fd, tmp = tempfile.mkstemp(prefix=".", suffix=".part", dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise

    def evict(self, keep_bytes: int | None = None) -> None:
        """Remove the least recently used blocks until the cache holds at most ``keep_bytes`` (default: the
        bound)."""
        keep_bytes = self.max_bytes if keep_bytes is None else keep_bytes
        blocks = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.endswith(BLOCK_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):  # another process evicted it meanwhile
                        st = entry.stat()
                        blocks.append((st.st_mtime_ns, entry.name, st.st_size))
        total = sum(size for _, _, size in blocks)
        for _, name, size in sorted(blocks):
            if total <= keep_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, name))
            total -= size

    def size_on_disk(self) -> int:
        """Bytes of blocks in the folder now (the figure the bound is about)."""
        total = 0
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.endswith(BLOCK_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat().st_size
        return total


class RemoteArray:
    """A remote file's bytes as a read-only 1-D array of ``dtype``, sliced like a memory map: ``a[i:j]`` reads the
    blocks that hold those items through ``cache`` (a copy, as ``np.array(memmap[i:j])``)."""

    def __init__(self, url: str, dtype: np.dtype, cache: BlockCache):
        self.url, self.dtype, self.cache = url, np.dtype(dtype), cache
        found = storage.info(url)
        self.nbytes, self.version = found.size, found.version
        self.shape = (self.nbytes // self.dtype.itemsize,)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError("a remote token array is read in slices")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise TypeError("a remote token array is read in contiguous slices")
        size = self.dtype.itemsize
        data = self.cache.read(self.url, self.version, self.nbytes, start * size, max(start, stop) * size)
        return np.frombuffer(data, dtype=self.dtype)
