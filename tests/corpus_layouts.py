"""Small corpora in every layout the reader layer takes, holding the same records as a plain-JSONL reference.

``write_layout(name, root, shards)`` writes ``shards`` (two lists of records) as layout ``name`` under ``root`` and
returns the command-line inputs that name them, in the order whose records equal ``shards[0] + shards[1]``.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from mtnlg_lightning.corpora.formats import detect
from mtnlg_lightning.corpora.readers import iter_raw

LAYOUTS = ("plain", "gzip", "zstd", "misleading", "parquet", "json_array", "folder", "glob", "mix")


def jsonl_bytes(records) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def _write(path: Path, records, how: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = jsonl_bytes(records)
    if how == "parquet":
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=max(1, len(records) // 3))
        return path
    if how.startswith("json_array"):
        data = ("[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n]\n").encode()
        how = how.removeprefix("json_array").lstrip("_") or "plain"
    if how == "gzip":
        data = gzip.compress(data, mtime=0)
    elif how == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def write_layout(name: str, root: Path, shards: list[list[dict]]) -> list[str]:
    a, b = shards
    if name == "plain":
        return [str(_write(root / "a.jsonl", a, "plain")), str(_write(root / "b.jsonl", b, "plain"))]
    if name == "gzip":
        return [str(_write(root / "a.jsonl.gz", a, "gzip")), str(_write(root / "b.jsonl.gz", b, "gzip"))]
    if name == "zstd":
        return [str(_write(root / "a.jsonl.zst", a, "zstd")), str(_write(root / "b.jsonl.zst", b, "zstd"))]
    if name == "misleading":  # RedPajama's *.json.gz.dedup.classifier.jsonl.zst, and worse
        return [str(_write(root / "a.json.gz.dedup.jsonl", a, "zstd")), str(_write(root / "b.jsonl.zst", b, "gzip"))]
    if name == "parquet":
        return [str(_write(root / "a.parquet", a, "parquet")), str(_write(root / "b.parquet", b, "parquet"))]
    if name == "json_array":
        return [str(_write(root / "a.json", a, "json_array")), str(_write(root / "b.json.gz", b, "json_array_gzip"))]
    if name == "folder":  # a Dolma-style tree; files sorted by path, README ignored
        _write(root / "docs" / "x" / "a.jsonl.gz", a, "gzip")
        _write(root / "docs" / "y" / "z" / "b.jsonl.zst", b, "zstd")
        (root / "docs" / "README.md").write_text("not data\n")
        return [str(root / "docs")]
    if name == "glob":
        _write(root / "data" / "d1" / "part.jsonl.zst", a, "zstd")
        _write(root / "data" / "d2" / "part.jsonl.zst", b, "zstd")
        return [str(root / "data" / "*" / "*.zst")]
    if name == "mix":
        return [str(_write(root / "a.parquet", a, "parquet")), str(_write(root / "b.jsonl.zst", b, "zstd"))]
    raise ValueError(name)


def read_records(path) -> list[dict]:
    """The records of any output file (format from its bytes)."""
    out = []
    for _, item in iter_raw(str(path), detect(str(path))):
        out.append(json.loads(item) if isinstance(item, bytes) else item)
    return out


def decompressed(path) -> bytes:
    fmt = detect(str(path))
    if fmt.compression == "gzip":
        return gzip.decompress(Path(path).read_bytes())
    if fmt.compression == "zstd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(Path(path).read_bytes())
    return Path(path).read_bytes()
