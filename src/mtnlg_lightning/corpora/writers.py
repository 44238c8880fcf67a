"""Outputs that fit their inputs: JSON lines in a compression, a JSON array, or parquet; all atomic.

A tool that wrote its kept records as plain JSON lines (one per input record, unchanged bytes) hands them here to
be written the way its input was: :func:`encode_jsonl` (compressed or as a JSON array) or, for a parquet input,
:func:`filter_parquet` (the input's own rows and schema, the kept ones only, so that no value goes through JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from typing import IO

import numpy as np

from mtnlg_lightning.corpora.formats import Format, need, open_write
from mtnlg_lightning.corpora.jsonl import atomic_write
from mtnlg_lightning.corpora.readers import parquet_file


@contextlib.contextmanager
def compressed_output(path: str, compression: str, fsync: bool = False) -> Iterator[IO[bytes]]:
    """Write ``path`` atomically through ``compression`` ("none", "gzip" or "zstd")."""
    with atomic_write(path, "wb", fsync=fsync) as raw:
        stream = open_write(raw, compression)
        try:
            yield stream
        finally:
            stream.close()  # the compressor's end of frame; ``raw`` stays open for atomic_write to finish


def encode_jsonl(plain: str | Sequence[str], dest: str, fmt: Format, fsync: bool = True) -> None:
    """``plain`` (JSON lines; several files are read one after the other) to ``dest`` as ``fmt`` ("jsonl" or
    "json" in any compression), atomically."""
    sources = [plain] if isinstance(plain, str) else list(plain)
    if fmt.plain_jsonl:  # the bytes as they are: copied by the kernel, never through this process
        with atomic_write(dest, "wb", fsync=fsync) as out:
            for source in sources:
                append_file(source, out)
        return
    with compressed_output(dest, fmt.compression, fsync=fsync) as out:
        first = True
        for source in sources:
            with open(source, "rb") as src:
                if fmt.kind != "json":
                    shutil.copyfileobj(src, out, 1 << 22)
                    continue
                for line in src:
                    line = line.rstrip(b"\r\n")
                    if line:
                        out.write(b"[\n" if first else b",\n")
                        out.write(line)
                        first = False
        if fmt.kind == "json":
            out.write(b"[\n]\n" if first else b"\n]\n")


def append_file(source: str, out: IO[bytes]) -> None:
    """The bytes of the file ``source`` appended to the open file ``out`` (``os.copy_file_range`` where the system
    has it: no copy through user space)."""
    out.flush()
    with open(source, "rb") as src:
        size = os.fstat(src.fileno()).st_size
        copy = getattr(os, "copy_file_range", None)
        done = 0
        try:
            while copy is not None and done < size:
                n = copy(src.fileno(), out.fileno(), size - done)
                if n == 0:
                    break
                done += n
        except OSError:  # a file system that refuses it: the ordinary way from where it stopped
            pass
        if done < size:
            src.seek(done)
            out.seek(0, os.SEEK_END)
            shutil.copyfileobj(src, out, 1 << 22)
    out.seek(0, os.SEEK_END)


def filter_parquet(src: str, dest: str, keep_rows: np.ndarray, fsync: bool = True) -> int:
    """The rows of ``src`` whose 0-based index is in ``keep_rows`` (sorted), same schema and codec, to ``dest``
    atomically; one record batch in memory at a time. Returns the rows written."""
    pa = need("pyarrow", src, "parquet")
    pq = need("pyarrow.parquet", src, "parquet")
    pf = parquet_file(src)
    keep_rows = np.asarray(keep_rows, dtype=np.int64)
    written = 0
    with atomic_write(dest, "wb", fsync=fsync) as raw:
        writer = pq.ParquetWriter(raw, pf.schema_arrow, compression=parquet_codec(src))
        try:
            base = 0
            for batch in pf.iter_batches(batch_size=65536):
                lo, hi = np.searchsorted(keep_rows, [base, base + batch.num_rows])
                if hi > lo:
                    picked = batch.take(pa.array(keep_rows[lo:hi] - base))
                    writer.write_batch(picked)
                    written += picked.num_rows
                base += batch.num_rows
            if not written:
                writer.write_table(pf.schema_arrow.empty_table())
        finally:
            writer.close()
    return written


def jsonl_to_parquet(plain: str, dest: str, schema, codec: str = "snappy", batch_rows: int = 4096) -> int:
    """JSON lines (records that came from a parquet file, fields possibly added) to parquet with ``schema``,
    atomically, ``batch_rows`` records in memory at a time. Returns the rows written."""
    pa = need("pyarrow", plain, "parquet")
    pq = need("pyarrow.parquet", plain, "parquet")
    written = 0
    with atomic_write(dest, "wb", fsync=True) as raw, open(plain, "rb") as src:
        writer = pq.ParquetWriter(raw, schema, compression=codec)
        try:
            rows: list[dict] = []
            for line in src:
                rows.append(json.loads(line))
                if len(rows) == batch_rows:
                    writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                    written += len(rows)
                    rows = []
            if rows or not written:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                written += len(rows)
        finally:
            writer.close()
    return written


def parquet_codec(path: str) -> str:
    meta = parquet_file(path).metadata
    if not (meta.num_row_groups and meta.num_columns):
        return "snappy"
    codec = meta.row_group(0).column(0).compression.lower()
    return "none" if codec == "uncompressed" else codec
