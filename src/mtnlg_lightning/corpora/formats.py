"""A file's format from its first bytes: JSON lines / JSON array (plain, gzip, zstd) or parquet.

Compression is never guessed from the name (RedPajama names zstd files ``*.json.gz.dedup.classifier.jsonl.zst``
and the names of hand-made shards lie in every direction); gzip, zstd and parquet have magic numbers, and a
JSON array is told from JSON lines by its first non-blank byte after decompression.
"""

from __future__ import annotations

import gzip
import importlib
import io
from dataclasses import dataclass
from typing import IO

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.corpora.storage import CorpusError
from mtnlg_lightning.extras import install_hint

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
PARQUET_MAGIC = b"PAR1"
COMPRESSIONS = ("none", "gzip", "zstd")
# fast levels: the tools stream at the speed of their own work (zstd 3 took 0.4 s and gzip 6 1.8 s of CPU per
# 23 MB where dedup spends ~3.5 s on the same documents; levels 1 take 0.1 s and ~0.6 s for a few % more bytes)
GZIP_LEVEL = 1
ZSTD_LEVEL = 1
_SUFFIX = {"gzip": ".gz", "zstd": ".zst"}


@dataclass(frozen=True)
class Format:
    kind: str  # "jsonl" (one JSON object per line), "json" (a JSON array of objects) or "parquet"
    compression: str = "none"  # "none", "gzip" or "zstd" (parquet compresses inside the file)

    @property
    def plain_jsonl(self) -> bool:
        return self.kind == "jsonl" and self.compression == "none"

    def __str__(self) -> str:
        return self.kind if self.compression == "none" else f"{self.kind}+{self.compression}"


def need(module: str, path: str, what: str):
    """Import an optional package of the ``corpora`` extra, or fail with one line naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise CorpusError(f"{path}: reading {what} needs the '{package}' package: {install_hint('corpora')}") from None


def open_read(path: str, compression: str) -> IO[bytes]:
    """A binary stream of the decompressed bytes of a file or URL (read in blocks: memory bounded whatever the
    file size; a URL streams in ranged requests)."""
    if compression == "gzip":
        return _OwningGzip(storage.open_binary(path))
    if compression == "zstd":
        zstd = need("zstandard", path, "zstd")
        raw = storage.open_binary(path)
        return io.BufferedReader(zstd.ZstdDecompressor().stream_reader(raw, closefd=True), 1 << 20)
    return storage.open_binary(path)


class _OwningGzip(gzip.GzipFile):
    """A gzip reader that closes the stream it reads (``gzip.open`` does so only for a file it opened itself)."""

    def __init__(self, raw: IO[bytes]):
        super().__init__(fileobj=raw, mode="rb")
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


def detect(path: str) -> Format:
    """What ``path`` holds, from its first bytes; raises :class:`CorpusError` (one line) when it cannot be read
    or the package its format needs is missing (checked here, before any work starts)."""
    try:
        with storage.open_binary(path) as f:
            head = f.read(4)
    except IsADirectoryError:
        raise CorpusError(f"{path}: is a directory, expected a data file") from None
    except FileNotFoundError:
        raise CorpusError(f"{path}: no such file (it does not exist)") from None
    except OSError as err:
        raise CorpusError(f"{path}: cannot read: {err.strerror or err}") from None
    if not head:
        raise CorpusError(f"{path}: empty input: the file is empty")
    if head == PARQUET_MAGIC:
        need("pyarrow.parquet", path, "parquet")
        return Format("parquet")
    compression = "gzip" if head[:2] == GZIP_MAGIC else "zstd" if head == ZSTD_MAGIC else "none"
    try:
        with open_read(path, compression) as f:
            start = f.read(4096).lstrip()
    except CorpusError:
        raise
    except Exception as err:  # a truncated or corrupt file: OSError, EOFError, zstandard.ZstdError
        raise CorpusError(f"{path}: cannot decompress ({compression}): {' '.join(str(err).split())}") from None
    if not start:
        raise CorpusError(f"{path}: empty input (no records)")
    return Format("json" if start[:1] == b"[" else "jsonl", compression)


def open_write(raw: IO[bytes], compression: str) -> IO[bytes]:
    """A binary stream writing ``compression`` into ``raw`` (left open). Deterministic bytes: the gzip header
    carries no time and no name, so the same records give the same file on every run."""
    if compression == "gzip":
        return gzip.GzipFile(filename="", mode="wb", compresslevel=GZIP_LEVEL, fileobj=raw, mtime=0)
    if compression == "zstd":
        zstd = need("zstandard", getattr(raw, "name", "output"), "zstd")
        return zstd.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(raw, closefd=False)
    return _Unclosing(raw)


class _Unclosing(io.RawIOBase):
    """``raw`` seen through a stream whose close() leaves it open (as the compressors do)."""

    def __init__(self, raw: IO[bytes]):
        self.raw = raw

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return self.raw.write(b)


def output_name(name: str, source: Format, compression: str | None) -> str:
    """The output's name for an input named ``name``: the same name unless another compression is asked for,
    then with the old compression suffix (if any) replaced by the new one's."""
    if compression is None or source.kind == "parquet" or compression == source.compression:
        return name
    for suffix in (".gz", ".gzip", ".zst", ".zstd"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name + _SUFFIX.get(compression, "")
