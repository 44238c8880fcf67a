"""Reading WARC / WET files record by record, surviving corrupt records.

warcio reads one record after another; a corrupt gzip member or a garbled record header makes its iterator raise
and stop. A crawl file of 40,000 pages must not be lost to one bad record, so the reader notes the failure and
resynchronises on the next record start (the next gzip member that opens with ``WARC/``, or the next ``WARC/1.``
line in an uncompressed file) and carries on from there.

Records are numbered in file order, broken ones included; every reader of the same file sees the same numbers,
which is what lets several workers split one file by record number and still write the same output.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import mtnlg_lightning.corpora.storage as storage

GZIP_MAGIC = b"\x1f\x8b\x08"
WARC_LINE = b"WARC/1."
_SCAN_BLOCK = 1 << 20


@dataclass
class BrokenRecord:
    """A stretch of the file that did not parse as a WARC record; ``reason`` names the failure."""

    offset: int
    reason: str
    error: str = ""  # the exception warcio raised


def _looks_like_record_start(f, pos: int, gzipped: bool) -> bool:
    f.seek(pos)
    head = f.read(512)
    if not gzipped:
        return head.startswith(WARC_LINE)
    try:
        return zlib.decompressobj(31).decompress(head, 16).startswith(b"WARC/")
    except zlib.error:
        return False


def next_record_start(f, start: int, gzipped: bool) -> int | None:
    """Offset of the first record start at or after ``start``, or None at the end of the file."""
    marker = GZIP_MAGIC if gzipped else WARC_LINE
    pos = start
    while True:
        f.seek(pos)
        block = f.read(_SCAN_BLOCK + len(marker))
        if not block:
            return None
        i = block.find(marker)
        while i != -1:
            if (gzipped or i + pos == 0 or block[i - 1 : i] == b"\n") and _looks_like_record_start(f, pos + i, gzipped):
                return pos + i
            i = block.find(marker, i + 1)
        if len(block) <= len(marker):
            return None
        pos += _SCAN_BLOCK


def is_gzipped(path: str) -> bool:
    return storage.read_bytes(path, 0, 3) == GZIP_MAGIC


def iter_records(path: str) -> Iterator[tuple[int, object]]:
    """Yield ``(number, record)`` for every record of a WARC/WET file, plain or gzip; ``record`` is a warcio
    ``ArcWarcRecord`` (read its content before asking for the next one) or a :class:`BrokenRecord`."""
    from warcio.archiveiterator import ArchiveIterator  # optional extra [crawl]: imported on use

    gzipped = is_gzipped(path)
    number = 0
    with storage.open_binary(path) as f:
        base = 0
        while True:
            f.seek(base)
            archive = ArchiveIterator(f, check_digests=False)
            records = iter(archive)
            while True:
                try:
                    record = next(records)
                except StopIteration:
                    return
                except Exception as err:  # warcio raises several types for a corrupt member or header
                    broken = BrokenRecord(base + archive.offset, "unreadable_record", type(err).__name__)
                    break
                if record.rec_type is None or record.rec_headers.get_header("Content-Length") is None:
                    # a header warcio half-parsed: its length is unknown, so whatever follows is suspect
                    offset = base + archive.get_record_offset()
                    broken = BrokenRecord(offset, "unreadable_record", "no WARC-Type or Content-Length")
                    break
                yield number, record
                number += 1
            yield number, broken
            number += 1
            resume = next_record_start(f, broken.offset + 1, gzipped)
            if resume is None:
                return
            base = resume
