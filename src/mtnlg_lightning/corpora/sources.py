"""Command-line inputs to files: paths, folders (searched recursively) and globs, in any mix.

The order is deterministic: inputs in command-line order, the files of a folder or a glob sorted by path. A
file named twice is read once. Every file gets a *name*, the path its output takes under an output directory:
its base name for a file named directly, its path below the folder (or below the glob's fixed part), so that the
shards of a tree (Dolma's ``documents/**``, FineWeb's ``data/CC-MAIN-*/000_00000.parquet``) keep their layout.

A URL (``s3://bucket/corpus/``, ``s3://bucket/data/*/*.parquet``, ``https://host/a.jsonl.gz``) is listed the same
way: a prefix is a folder, hidden names (``.staging``, ``_SUCCESS``) are passed over as on disk.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.corpora.storage import CorpusError

# files a folder search picks up: the names data shards go by (a folder also holds READMEs, checksums, _SUCCESS)
DATA_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet", ".gz", ".zst", ".zstd")
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class InputFile:
    path: str  # as the user can find it (relative paths stay relative)
    name: str  # output name, relative ('/' separated)


def is_data_file(name: str) -> bool:
    return not name.startswith((".", "_")) and (name.endswith(DATA_SUFFIXES) or ".jsonl." in name or ".json." in name)


def stem(name: str) -> str:
    """A file's base name without its data and compression suffixes (``lambada.jsonl.gz`` -> ``lambada``)."""
    base = os.path.basename(name)
    for suffix in (".gz", ".gzip", ".zst", ".zstd"):
        base = base.removesuffix(suffix)
    for suffix in (".jsonl", ".json", ".ndjson", ".parquet"):
        base = base.removesuffix(suffix)
    return base


def _walk(root: str) -> list[str]:
    found = []
    for d, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        found += [os.path.join(d, f) for f in files if is_data_file(f)]
    return sorted(found)


def _glob_root(pattern: str) -> str:
    parts = pattern.split(os.sep)
    fixed = []
    for p in parts[:-1]:
        if any(c in p for c in _GLOB_CHARS):
            break
        fixed.append(p)
    return os.sep.join(fixed) if fixed else "."


def _remote_files(spec: str) -> list[tuple[str, str]]:
    """(URL, name) of the files a URL names: one object, every data file below a prefix, or the objects a glob
    matches; hidden names are passed over on the way, as on disk (a commit's staging prefix is one)."""
    scheme, path = spec.split("://", 1)
    # an http(s) URL is one file: its '?' starts a query, and a web server lists nothing
    if scheme.lower() not in ("http", "https") and any(c in path for c in _GLOB_CHARS):
        root = _glob_root(path).rstrip("/")
        files = []
        for url in storage.glob(spec):
            rel = url.split("://", 1)[1][len(root) + 1 :] if root != "." else storage.basename(url)
            if not any(part.startswith(".") for part in rel.split("/")):
                files.append((url, rel))
        if not files:
            raise CorpusError(f"{spec}: the pattern matches no file")
        return files
    if scheme.lower() in ("http", "https") or not storage.info(spec).is_dir:
        return [(spec, storage.basename(spec.split("?", 1)[0]))]
    root = f"{scheme}://{path.rstrip('/')}/"
    files = []
    for url in storage.list_files(spec):
        *folders, base = url[len(root) :].split("/")
        if is_data_file(base) and not any(d.startswith(".") for d in folders):
            files.append((url, url[len(root) :]))
    if not files:
        raise CorpusError(f"{spec}: is a directory with no data files (*.jsonl, *.json, *.parquet, *.gz, *.zst)")
    return files


def expand_inputs(specs: list[str]) -> list[InputFile]:
    """Files of ``specs`` in a deterministic order; raises :class:`CorpusError` (one line) for a spec that
    matches nothing."""
    out: list[InputFile] = []
    seen: set[str] = set()

    def add(path: str, name: str) -> None:
        real = path if storage.is_url(path) else os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            out.append(InputFile(path, name.replace(os.sep, "/")))

    for spec in specs:
        if storage.is_url(spec):
            for url, name in _remote_files(spec):
                add(url, name)
        elif os.path.isdir(spec):
            files = _walk(spec)
            if not files:
                kinds = "*.jsonl, *.json, *.parquet, *.gz, *.zst"
                raise CorpusError(f"{spec}: is a directory with no data files ({kinds})")
            for f in files:
                add(f, os.path.relpath(f, spec))
        elif os.path.exists(spec):
            add(spec, os.path.basename(spec))
        elif any(c in spec for c in _GLOB_CHARS):
            files = sorted(f for f in glob.glob(spec, recursive=True) if os.path.isfile(f))
            if not files:
                raise CorpusError(f"{spec}: the pattern matches no file")
            root = _glob_root(spec)
            for f in files:
                add(f, os.path.relpath(f, root))
        else:
            raise CorpusError(f"{spec}: no such file (it does not exist)")
    if not out:
        raise CorpusError("no input files given")
    return out
