"""JSONL input/output helpers shared by the curation tools.

* Reading validates every record and raises :class:`InputError` with a one-line message that names the
  file and the 1-based line number (invalid JSON, not an object, missing or non-string text key).
* Blank lines are skipped (they are not records); line numbers still count them.
* Writing is atomic: data goes to a temporary file in the destination directory, which is moved into
  place with ``os.replace`` (fsynced first for final outputs): a reader never sees a half-written output.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import mtnlg_lightning.corpora.commit as commit
import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning import outputs
from mtnlg_lightning.corpora.records import SKIP_HINT, BadRecord, check_line, locate
from mtnlg_lightning.errors import InputError, MTNLGError


def check_input_files(paths: list[str]) -> None:
    """Fail early (before any output is written) on missing, unreadable or empty input files."""
    for path in paths:
        if storage.is_url(path):
            found = storage.info(path)  # one line for a missing bucket or key, refused credentials
            if found.is_dir:
                raise InputError(f"{path}: is a directory, expected a JSONL file")
            if found.size == 0:
                raise InputError(f"{path}: empty input (no records)")
            continue
        if not os.path.exists(path):
            raise InputError(f"{path}: no such file")
        if os.path.isdir(path):
            raise InputError(f"{path}: is a directory, expected a JSONL file")
        if not os.access(path, os.R_OK):
            raise InputError(f"{path}: not readable")
        if os.path.getsize(path) == 0:
            raise InputError(f"{path}: empty input (no records)")


def parse_record(line: bytes | str, path: str, lineno: int, text_key: str) -> tuple[dict, str]:
    """Parse one JSONL line and return ``(record, text)``; raise :class:`InputError` naming file:line (the rules
    of a good record are :mod:`mtnlg_lightning.corpora.records`')."""
    try:
        return check_line(line, text_key)
    except BadRecord as err:
        raise InputError(f"{path}:{lineno}: {err}") from None


def shard_bad_record(line: bytes, text_key: str, shard, local: int, policy: str, counts) -> str | None:
    """The text of one line of a shard (a byte range of a plain file), or None for a bad record under
    ``policy`` "skip" (counted in ``counts`` by reason); under "error" raise one line naming the input (as the
    user named it) and the record's line, row or item number in the whole file."""
    try:
        return check_line(line, text_key)[1]
    except BadRecord as err:
        if policy == "skip":
            counts[err.reason] += 1
            return None
        lineno = count_lines_before(shard.path, shard.start) + local
        where = locate(shard.label or shard.path, shard.kind, lineno)
        raise InputError(f"{where}: {err}{SKIP_HINT}") from None


class ShardRecords:
    """The records of one shard (a byte range of a plain file), iterated as ``(byte_offset, raw_line, line, text)``
    with ``line`` numbered from 1 within the shard: blank lines passed over, bad records counted by reason in
    ``bad`` under policy "skip" (else one line naming the input and the record's line). ``lines`` counts every line
    read, blank and bad ones too."""

    def __init__(self, shard, text_key: str, policy: str):
        self.shard, self.text_key, self.policy = shard, text_key, policy
        self.lines = 0
        self.bad: Counter = Counter()

    def __iter__(self) -> Iterator[tuple[int, bytes, int, str]]:
        for off, line in iter_lines(self.shard.path, self.shard.start, self.shard.end):
            self.lines += 1
            if not line.strip():
                continue
            text = shard_bad_record(line, self.text_key, self.shard, self.lines, self.policy, self.bad)
            if text is not None:
                yield off, line, self.lines, text


def iter_lines(path: str, start: int = 0, end: int | None = None) -> Iterator[tuple[int, bytes]]:
    """Yield ``(byte_offset, raw_line)`` for lines that *start* in ``[start, end)`` (``start`` must be a
    line start). Raw lines keep their trailing newline."""
    with storage.open_binary(path) as f:
        f.seek(start)
        pos = start
        for line in f:
            if end is not None and pos >= end:
                break
            yield pos, line
            pos += len(line)


def iter_records(path: str, text_key: str = "text") -> Iterator[tuple[int, dict, str]]:
    """Yield ``(lineno, record, text)`` for every non-blank line of a JSONL file (validated)."""
    for lineno, (_, line) in enumerate(iter_lines(path), start=1):
        if not line.strip():
            continue
        rec, text = parse_record(line, path, lineno, text_key)
        yield lineno, rec, text


def line_starts_plan(path: str, target_bytes: int) -> list[tuple[int, int]]:
    """Split a file into byte ranges of about ``target_bytes`` aligned to line starts."""
    size = storage.getsize(path)
    bounds = [0]
    with storage.open_binary(path) as f:
        while True:
            nxt = bounds[-1] + max(1, target_bytes)
            if nxt >= size:
                break
            f.seek(nxt - 1)
            f.readline()  # finish the line that contains byte nxt-1
            pos = f.tell()
            if pos >= size:
                break
            bounds.append(pos)
    bounds.append(size)
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def shard_size(total_bytes: int, max_bytes: int, cpus: int, min_bytes: int = 1 << 20, per_cpu: int = 4) -> int:
    """Shard size for a run: at most ``max_bytes``, and small enough for ~``per_cpu`` tasks per CPU (load balance
    on small inputs), but not below ``min_bytes`` unless ``max_bytes`` is (per-task overhead)."""
    return min(max_bytes, max(min_bytes, total_bytes // (per_cpu * max(1, cpus))))


def count_lines_before(path: str, offset: int) -> int:
    """Number of newline characters before ``offset`` (used to turn shard-local line numbers into global ones)."""
    n = 0
    with storage.open_binary(path) as f:
        remaining = offset
        while remaining > 0:
            chunk = f.read(min(remaining, 1 << 20))
            if not chunk:
                break
            n += chunk.count(b"\n")
            remaining -= len(chunk)
    return n


# One atomic_write for every tool (mtnlg_lightning.outputs); the curation modules import it from here.
atomic_write = outputs.atomic_write


def guard_output(path: str, inputs: list[str]) -> None:
    """`outputs.check_output` for an output file or URL, as the curation tools' `InputError`."""
    try:
        commit.check_output(path, inputs, replaces_dir=False)
    except MTNLGError as error:
        raise InputError(str(error)) from None


def write_json_atomic(path: str, obj: Any, fsync: bool = False) -> None:
    """The curation tools' reports: `outputs.write_json`, indented by 2, non-ASCII text kept as it is."""
    outputs.write_json(path, obj, fsync, indent=2, ensure_ascii=False)


def dumps_line(obj: Any) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
