"""Task files: records in any corpus format checked as they are read (a malformed one is one error naming
file:line)."""

from __future__ import annotations

import csv
from pathlib import Path

from mtnlg_lightning.corpora.formats import detect
from mtnlg_lightning.corpora.readers import iter_objects
from mtnlg_lightning.corpora.sources import is_data_file
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.outputs import check_input_file


def read_records(path: str | Path, fields: tuple[str, ...]) -> list[dict]:
    """JSON lines, or a tab-separated file with a header row (`.txt`/`.tsv`, as HANS ships its data)."""
    path = Path(path)
    if not path.is_dir() and not any(c in str(path) for c in "*?["):  # a folder or glob: the corpus reader's
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
    """Records of a file, folder or glob in any corpus format (JSON lines plain/gzip/zstd, JSON arrays, parquet;
    :mod:`mtnlg_lightning.corpora`), each with non-empty string ``fields``."""
    if not Path(path).exists() and not any(c in str(path) for c in "*?["):
        raise MTNLGError(f"{path} does not exist")
    records = []
    for where, record in iter_objects([str(path)]):
        missing = [k for k in fields if not isinstance(record.get(k), str) or not record[k].strip()]
        if missing:
            raise MTNLGError(f"{where}: missing or empty text field(s) {', '.join(missing)}")
        records.append(record)
    if not records:
        raise MTNLGError(f"{path} holds no records")
    return records


def read_documents(path: str | Path) -> list[str]:
    """Documents for perplexity: the `text` of every record of a corpus (file, folder or glob in any format of
    :mod:`mtnlg_lightning.corpora`), or a whole text file (`.txt`, or any name without a data suffix) as one
    document."""
    path = Path(path)
    if not path.is_file() or is_data_file(path.name) or (path.stat().st_size and not detect(str(path)).plain_jsonl):
        return [r["text"] for r in read_jsonl(path, ("text",))]
    check_input_file(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise MTNLGError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    if not text.strip():
        raise MTNLGError(f"{path} is empty")
    return [text]
