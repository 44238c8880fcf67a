"""What a good record is, and what to do with a bad one (``--on-bad-record error|skip``).

A record is a JSON object whose text field holds a non-empty string. Bad records, by reason: ``malformed_json``
(not JSON, or JSON that is not an object), ``non_utf8`` (bytes that are not UTF-8), ``missing_field`` (no text
field), ``non_string_text`` (the text is a number, a list, null...), ``empty_text`` (an empty string). With
``error`` (the default) the first bad record stops the tool with one line naming its file and line (or row);
with ``skip`` it is left out and counted under its reason, and the counts go to the summary and the report.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

from mtnlg_lightning.corpora.formats import CorpusError

BAD_REASONS = ("malformed_json", "non_utf8", "missing_field", "non_string_text", "empty_text")
POLICIES = ("error", "skip")
SKIP_HINT = " (--on-bad-record skip leaves such records out)"


class BadRecord(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _one_line(msg: object, limit: int = 160) -> str:
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def parse_line(line: bytes | str) -> dict:
    """A JSON line to its object; raises :class:`BadRecord`."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadRecord("non_utf8", f"not UTF-8 (invalid byte at {err.start})") from None
    try:
        rec = json.loads(line)
    except ValueError as err:
        raise BadRecord("malformed_json", f"invalid JSON: {_one_line(err)}") from None
    if not isinstance(rec, dict):
        raise BadRecord("malformed_json", f"expected a JSON object, got {type(rec).__name__}")
    return rec


def text_of(rec: dict, text_key: str) -> str:
    """The record's text; raises :class:`BadRecord`."""
    try:
        text = rec[text_key]
    except KeyError:
        raise BadRecord("missing_field", f"missing text key {text_key!r}") from None
    if not isinstance(text, str):
        raise BadRecord("non_string_text", f"text key {text_key!r} is {type(text).__name__}, expected a string")
    if not text:
        raise BadRecord("empty_text", f"text key {text_key!r} is an empty string")
    return text


def check_line(line: bytes | str, text_key: str) -> tuple[dict, str]:
    rec = parse_line(line)
    return rec, text_of(rec, text_key)


def locate(path: str, kind: str, n: int) -> str:
    """Where a record is, for messages: ``FILE:LINE`` for JSON lines, ``FILE:row N`` / ``FILE:item N`` (1-based)
    for parquet and JSON arrays."""
    if kind == "parquet":
        return f"{path}:row {n}"
    if kind == "json":
        return f"{path}:item {n}"
    return f"{path}:{n}"


@dataclass
class BadRecordPolicy:
    """``error``: raise one line naming the record; ``skip``: count it by reason."""

    mode: str = "error"

    def __post_init__(self):
        if self.mode not in POLICIES:
            raise CorpusError(f"--on-bad-record must be one of {', '.join(POLICIES)}, got {self.mode!r}")
        self.counts: Counter = Counter()

    def bad(self, err: BadRecord, where: str) -> None:
        if self.mode == "error":
            raise CorpusError(f"{where}: {err}{SKIP_HINT}") from None
        self.counts[err.reason] += 1

    def summary(self) -> dict[str, int]:
        """Counts for every reason (zeros included, so that reports have a fixed shape)."""
        return {r: int(self.counts.get(r, 0)) for r in BAD_REASONS}


def format_bad(counts: dict[str, int]) -> str:
    """``skipped N bad records (malformed json 2, empty text 1)``, the same words in every tool's summary."""
    total = sum(counts.values())
    kinds = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items() if v)
    return f"skipped {total} bad records" + (f" ({kinds})" if kinds else "")


@dataclass
class Record:
    text: str
    id: object
    source: str  # the input's name
    n: int  # line (JSON lines) or 1-based row / item number
    data: dict  # the whole record (the columns read, for parquet)
