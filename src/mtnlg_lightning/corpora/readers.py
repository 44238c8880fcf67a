"""The records of one file, streamed: memory holds a block of bytes or one parquet record batch, never a file.

:func:`iter_raw` yields ``(n, item)``: for JSON lines ``n`` is the line number (blank lines count but are not
yielded) and ``item`` the raw line's bytes; for a JSON array ``n`` is the 1-based item and ``item`` the object;
for parquet ``n`` is the 1-based row and ``item`` a dict of the columns read. :func:`iter_records` checks each
one (:mod:`.records`) and yields :class:`~.records.Record` with its text, id and place.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Iterator

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.corpora.formats import CorpusError, Format, detect, need, open_read
from mtnlg_lightning.corpora.records import BadRecord, BadRecordPolicy, Record, locate, parse_line, text_of
from mtnlg_lightning.corpora.sources import InputFile, expand_inputs

PARQUET_BATCH_ROWS = 1024
_BLOCK = 1 << 20


def parquet_file(path: str):
    pq = need("pyarrow.parquet", path, "parquet")
    source = storage.open_random_access(path) if storage.is_url(path) else path
    try:
        return pq.ParquetFile(source)
    except Exception as err:  # pyarrow.ArrowInvalid: not a parquet file after all, or truncated
        raise CorpusError(f"{path}: cannot read parquet: {' '.join(str(err).split())}") from None


def _parquet_rows(path: str, columns: list[str] | None) -> Iterator[tuple[int, dict]]:
    pf = parquet_file(path)
    names = pf.schema_arrow.names
    cols = None if columns is None else [c for c in columns if c in names]
    n = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=cols):
        for row in batch.to_pylist():
            n += 1
            yield n, row


def _json_array(path: str, compression: str) -> Iterator[tuple[int, object]]:
    """Items of a top-level JSON array, decoded one at a time from a sliding buffer (never the whole file)."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf, pos, n, started, eof = "", 0, 0, False, False
    with open_read(path, compression) as f:

        def more() -> bool:
            nonlocal buf, pos, eof
            if eof:
                return False
            block = f.read(_BLOCK)
            eof = not block
            try:
                buf = buf[pos:] + utf8.decode(block, final=eof)
            except UnicodeDecodeError:
                raise CorpusError(f"{locate(path, 'json', n + 1)}: not UTF-8") from None
            pos = 0
            return True

        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos >= len(buf):
                if more():
                    continue
                raise CorpusError(f"{path}: the JSON array is not closed")
            c = buf[pos]
            if not started:
                started, pos = True, pos + 1  # the '[' that detect() saw
                continue
            if c == "]":
                return
            if c == "," and n:
                pos += 1
                continue
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except ValueError as err:
                if more():
                    continue  # the item runs past the buffer: read on
                raise CorpusError(f"{locate(path, 'json', n + 1)}: invalid JSON: {err}") from None
            if end == len(buf) and not eof and more():  # a number may go on in the next block
                continue
            n += 1
            pos = end
            yield n, obj


def iter_raw(path: str, fmt: Format, columns: list[str] | None = None) -> Iterator[tuple[int, object]]:
    if fmt.kind == "parquet":
        yield from _parquet_rows(path, columns)
    elif fmt.kind == "json":
        yield from _json_array(path, fmt.compression)
    else:
        with open_read(path, fmt.compression) as f:
            for n, line in enumerate(f, start=1):
                if line.strip():
                    yield n, line


def iter_records(
    files: Iterable[InputFile],
    text_key: str = "text",
    id_key: str | None = "id",
    policy: BadRecordPolicy | None = None,
    formats: dict[str, Format] | None = None,
) -> Iterator[Record]:
    """Good records of every file in order; bad ones go to ``policy`` (default: stop at the first).

    ``id`` is the record's ``id_key`` field when it has one, else ``NAME:N`` (file name and line or row)."""
    policy = policy or BadRecordPolicy()
    columns = [text_key] + ([id_key] if id_key else [])
    for file in files:
        fmt = (formats or {}).get(file.path) or detect(file.path)
        for n, item in iter_raw(file.path, fmt, columns):
            try:
                rec = parse_line(item) if isinstance(item, bytes) else item
                if not isinstance(rec, dict):
                    raise BadRecord("malformed_json", f"expected a JSON object, got {type(rec).__name__}")
                text = text_of(rec, text_key)
            except BadRecord as err:
                policy.bad(err, locate(file.path, fmt.kind, n))
                continue
            rid = rec.get(id_key) if id_key else None
            yield Record(text, rid if rid is not None else f"{file.name}:{n}", file.name, n, rec)


def iter_objects(specs: list[str]) -> Iterator[tuple[str, dict]]:
    """(place, record) of every record of the files `specs` names (files, folders, globs, URLs), in order: the
    readers of task and fine-tuning files, which stop at the first record that is no JSON object (one line naming
    its file and line, row or item)."""
    for file in expand_inputs(specs):
        fmt = detect(file.path)
        for n, item in iter_raw(file.path, fmt):
            where = locate(file.path, fmt.kind, n)
            try:
                record = parse_line(item) if isinstance(item, bytes) else item
            except BadRecord as err:
                detail = str(err).removeprefix("invalid JSON: ")
                wording = f"not valid JSON ({detail})" if err.reason == "malformed_json" else detail
                raise CorpusError(f"{where}: {wording}") from None
            if not isinstance(record, dict):
                raise CorpusError(f"{where}: expected a JSON object")
            yield where, record


def batched(items: Iterable, size: int) -> Iterator[list]:
    """`items` in lists of `size` (the last one shorter), for batch encoders and scorers: itertools.batched (Python
    3.12) as lists, on Python 3.10 too."""
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
