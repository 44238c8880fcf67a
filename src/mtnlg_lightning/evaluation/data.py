"""Task files: JSON lines checked as they are read (a malformed line is one error naming file:line)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.outputs import check_input_file


def read_records(path: str | Path, fields: tuple[str, ...]) -> list[dict]:
    """JSON lines, or a tab-separated file with a header row (`.txt`/`.tsv`, as HANS ships its data)."""
    path = Path(path)
    check_input_file(path)
    try:
        return read_tsv(path, fields) if path.suffix in (".txt", ".tsv") else read_jsonl(path, fields)
    except UnicodeDecodeError as error:
        raise MTNLGError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None


def read_tsv(path: Path, fields: tuple[str, ...]) -> list[dict]:
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    for number, row in enumerate(rows, start=2):
        missing = [k for k in fields if not (row.get(k) or "").strip()]
        if missing:
            raise MTNLGError(f"{path}:{number}: missing or empty column(s) {', '.join(missing)}")
    if not rows:
        raise MTNLGError(f"{path} holds no records")
    return rows


def read_jsonl(path: str | Path, fields: tuple[str, ...]) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise MTNLGError(f"{path} does not exist")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise MTNLGError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise MTNLGError(f"{path}:{number}: expected a JSON object")
            missing = [k for k in fields if not isinstance(record.get(k), str) or not record[k].strip()]
            if missing:
                raise MTNLGError(f"{path}:{number}: missing or empty text field(s) {', '.join(missing)}")
            records.append(record)
    if not records:
        raise MTNLGError(f"{path} holds no records")
    return records


def read_documents(path: str | Path) -> list[str]:
    """Documents for perplexity: the `text` of each line of a .jsonl file, or a whole text file as one document."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return [r["text"] for r in read_records(path, ("text",))]
    check_input_file(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise MTNLGError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    if not text.strip():
        raise MTNLGError(f"{path} is empty")
    return [text]
