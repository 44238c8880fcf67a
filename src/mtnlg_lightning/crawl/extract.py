"""WARC/WET records to JSON lines of text: HTML to text (html_text.py: trafilatura, or jusText with the stop-word
list of the page's language), the language of the text (pyCLD2), every failure counted by reason and never fatal.

One task reads one file and handles the records whose number falls in its part (``number % parts == part``);
the driver merges the parts of a file by record number, so a file's shard is the same bytes whatever the number
of workers or the engine.
"""

from __future__ import annotations

import codecs
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.corpora.commit import destination
from mtnlg_lightning.corpora.engine import make_engine
from mtnlg_lightning.corpora.jsonl import InputError, atomic_write, dumps_line, write_json_atomic
from mtnlg_lightning.crawl.html_text import page_text
from mtnlg_lightning.crawl.language import BAD_CHARS, identify_language
from mtnlg_lightning.crawl.warc import BrokenRecord, iter_records

# trafilatura first: the default, chosen by benchmarks/bench_crawl_languages.py (every page of 14 languages kept)
EXTRACTORS = ("trafilatura", "justext")
HTML_TYPES = ("text/html", "application/xhtml+xml")
# Records that are not pages and are passed over without being counted as failures.
NON_PAGE_TYPES = ("warcinfo", "request", "metadata", "revisit")
_CHARSET = re.compile(rb"""<meta[^>]+charset=["']?([A-Za-z0-9_.:-]+)""", re.IGNORECASE)


@dataclass(frozen=True)
class ExtractSettings:
    extractor: str = EXTRACTORS[0]
    languages: tuple[str, ...] = ()  # keep only these ISO 639-1 codes; empty: keep every language
    min_chars: int = 1  # a page whose extracted text is shorter is dropped as no_text
    policy_lines: bool = False  # keep lines C4 removes (cookie and privacy notices, "enable JavaScript")


@dataclass(frozen=True)
class Part:
    path: str
    part: int
    parts: int


# --- HTML to text ------------------------------------------------------------------------------------------------

# C4's line rule (Raffel et al. 2020; tensorflow-datasets c4_utils): lines naming a site policy or asking for
# JavaScript are boilerplate wherever they appear. jusText keeps a long cookie-consent paragraph (it reads like
# prose: long, full of stop words), so this runs after either extractor. English phrases only.
POLICY_SUBSTRINGS = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")


def drop_policy_lines(text: str) -> tuple[str, int]:
    """(text without C4's policy and JavaScript lines, how many were removed)"""
    kept, removed = [], 0
    for line in text.split("\n"):
        low = line.lower()
        if "javascript" in low or any(s in low for s in POLICY_SUBSTRINGS):
            removed += 1
        else:
            kept.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)), removed


def decode_html(payload: bytes, content_type: str) -> str | None:
    """Text of an HTML payload: the charset of the Content-Type header, else of a <meta> tag, else UTF-8; None when
    the bytes do not decode in it (a page in an unknown encoding is dropped, not guessed into mojibake)."""
    charsets = []
    m = re.search(r"charset=([A-Za-z0-9_.:-]+)", content_type, re.IGNORECASE)
    if m:
        charsets.append(m.group(1))
    m = _CHARSET.search(payload[:4096])
    if m:
        charsets.append(m.group(1).decode("ascii"))
    charsets.append("utf-8")
    for charset in charsets:
        try:
            codecs.lookup(charset)
        except LookupError:
            continue
        try:
            return payload.decode(charset)
        except UnicodeDecodeError:
            continue
    return None


# --- one record --------------------------------------------------------------------------------------------------


def _mime(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


class RecordResult(NamedTuple):
    document: dict | None
    outcome: str  # "ok" or the reason the record gave no document
    policy_lines_removed: int = 0
    lost_language: str | None = None  # no_main_text: the language of the page's prose, for the report


# The extractor kept no paragraph of a page that has text. Its own outcome, counted by the page's language and
# reported at the end: a language the extractor handles badly shows there instead of vanishing among empty pages.
NO_MAIN_TEXT = "no_main_text"


def record_to_document(record, settings: ExtractSettings) -> RecordResult:
    rec_type = record.rec_type
    if rec_type in NON_PAGE_TYPES:
        return RecordResult(None, f"skipped_{rec_type}")
    headers = record.rec_headers
    is_wet = rec_type == "conversion"
    if rec_type == "response":
        http = record.http_headers
        if http is None or not str(http.protocol).upper().startswith("HTTP/"):
            return RecordResult(None, "bad_http_headers")
        status = http.get_statuscode()
        if not str(status).startswith("2"):
            return RecordResult(None, "http_status_not_2xx")
        content_type = http.get_header("Content-Type") or ""
    else:
        content_type = headers.get_header("Content-Type") or ""
    mime = _mime(content_type)
    if not is_wet and mime not in HTML_TYPES:
        return RecordResult(None, "not_html")
    try:
        payload = record.content_stream().read()  # undoes Content-Encoding (gzip, deflate, br)
    except Exception:  # a body that says gzip and is not: zlib, brotli or EOF errors
        return RecordResult(None, "content_decoding")
    if not payload.strip():
        return RecordResult(None, "empty_payload")
    encoding = (record.http_headers.get_header("Content-Encoding") or "") if record.http_headers else ""
    if encoding.strip().lower() in ("gzip", "x-gzip") and payload[:2] == b"\x1f\x8b":
        return RecordResult(None, "content_decoding")  # warcio hands back the raw bytes when they do not decompress

    if is_wet:
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            return RecordResult(None, "undecodable")
    else:
        html = decode_html(payload, content_type)
        if html is None:
            return RecordResult(None, "undecodable")
        try:
            page = page_text(html, settings.extractor)
        except Exception:  # lxml ParserError and friends on markup too broken to parse
            return RecordResult(None, "html_parse_error")
        if not page.text.strip():
            return RecordResult(None, NO_MAIN_TEXT, lost_language=page.prose_language)
        text = page.text
    removed = 0
    if not settings.policy_lines:
        text, removed = drop_policy_lines(text)
    text = BAD_CHARS.sub("", text).strip()
    if len(text) < max(1, settings.min_chars):
        return RecordResult(None, "no_text")
    language, score, _ = identify_language(text)  # named from the text kept, whatever named the stop words
    if settings.languages and language not in settings.languages:
        return RecordResult(None, "language_not_kept")
    doc = {
        "id": headers.get_header("WARC-Record-ID") or "",
        "url": headers.get_header("WARC-Target-URI") or "",
        "date": headers.get_header("WARC-Date") or "",
        "text": text,
        "language": language,
        "language_score": round(score, 4),
    }
    return RecordResult(doc, "ok", removed)


def extract_part(settings: ExtractSettings, item: Part, on_record=None) -> dict:
    """One task: the records of ``item.path`` whose number is in part ``item.part`` of ``item.parts``.
    Returns the output lines with their record numbers and the counts by outcome. ``on_record()`` is called after
    each record handled (a progress bar, when the task runs in the driver)."""
    lines: list[tuple[int, bytes]] = []
    outcomes: Counter = Counter()
    languages: Counter = Counter()
    lost_languages: Counter = Counter()
    policy_lines = 0
    for number, record in iter_records(item.path):
        if number % item.parts != item.part:
            continue
        if on_record is not None:
            on_record()
        if isinstance(record, BrokenRecord):
            outcomes[record.reason] += 1
            continue
        try:
            result = record_to_document(record, settings)
        except Exception as err:  # never fatal: whatever a record does, the file goes on
            result = RecordResult(None, f"error:{type(err).__name__}")
        outcomes[result.outcome] += 1
        if result.lost_language is not None:
            lost_languages[result.lost_language] += 1
        if result.document is not None:
            policy_lines += result.policy_lines_removed
            lines.append((number, dumps_line(result.document)))
            languages[result.document["language"]] += 1
    return {
        "path": item.path,
        "lines": lines,
        "outcomes": dict(outcomes),
        "languages": dict(languages),
        "no_main_text_languages": dict(lost_languages),
        "policy_lines_removed": policy_lines,
    }


# --- a run -------------------------------------------------------------------------------------------------------

REPORT_NAME = "extract_report.json"
WARC_SUFFIXES = (".warc.wet.gz", ".warc.wet", ".warc.gz", ".wet.gz", ".arc.gz", ".warc", ".wet", ".gz")


def shard_name(path: str) -> str:
    """OUT/<input name without its WARC suffixes>.jsonl"""
    name = storage.basename(path)
    for suffix in WARC_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name + ".jsonl"


def check_inputs(paths: list[str]) -> None:
    """Every input a readable, non-empty WARC/WET file or URL, and no two writing the same shard; one line each."""
    seen: dict[str, str] = {}
    for path in paths:
        if storage.is_url(path):
            if storage.info(path).is_dir:
                raise InputError(f"{path}: not a file")
        elif not os.path.isfile(path):
            raise InputError(f"{path}: no such file" if not os.path.exists(path) else f"{path}: not a file")
        elif not os.access(path, os.R_OK):
            raise InputError(f"{path}: not readable")
        head = storage.read_bytes(path, 0, 512)
        if not head:
            raise InputError(f"{path}: empty input (no records)")
        if not (head.startswith(b"\x1f\x8b") or head.startswith(b"WARC/")):
            raise InputError(f"{path}: not a WARC/WET file (expected 'WARC/' or gzip at the start)")
        name = shard_name(path)
        if name in seen:
            raise InputError(f"{path} and {seen[name]} would both write {name}; rename one")
        seen[name] = path


MAX_PARTS_PER_FILE = 8


def parts_per_file(files: int, cpus: int) -> int:
    """Split each file into enough parts for ~2 tasks per CPU, at most MAX_PARTS_PER_FILE: a part inflates and
    parses the whole file but extracts only its own records; reading is ~3% of extracting (benchmarks/bench_crawl.py),
    so 8 parts cost ~25% more CPU than one. A crawl of many files runs one part per file."""
    return min(MAX_PARTS_PER_FILE, max(1, -(-2 * cpus // files))) if cpus > 1 else 1


def run_extract(
    inputs: list[str],
    output_dir: str,
    settings: ExtractSettings,
    workers: int = 1,
    engine: str = "local",
    ray_address: str | None = None,
    progress: bool = True,
) -> dict:
    """Extract every input into OUT/<name>.jsonl and write OUT/extract_report.json; returns the report."""
    check_inputs(inputs)
    dest = destination(output_dir)  # a URL: written in a scratch folder, committed at the end
    output_dir = dest.local
    os.makedirs(output_dir, exist_ok=True)
    t0 = time.perf_counter()
    runner = make_engine(engine, workers, ray_address)
    files: dict[str, dict] = {}
    try:
        cpus = runner.cpus  # asked before close(): a Ray started for the run is gone after it
        parts = parts_per_file(len(inputs), cpus)
        items = [Part(path, k, parts) for path in inputs for k in range(parts)]
        pending: list[dict] = []
        for result in _extracted(runner, items, settings, progress):
            pending.append(result)
            if len(pending) == parts:  # the parts of one file come in a row: its shard is complete
                path = pending[0]["path"]
                _write_shard(os.path.join(output_dir, shard_name(path)), pending)
                files[path] = {"output": shard_name(path), **_tally(pending)}
                pending = []
    finally:
        runner.close()
    report = {
        "inputs": len(inputs),
        **_tally(files.values()),
        "settings": {
            "extractor": settings.extractor,
            "languages": list(settings.languages),
            "min_chars": settings.min_chars,
            "policy_lines": settings.policy_lines,
        },
        "engine": engine,
        "workers": cpus,
        "seconds": round(time.perf_counter() - t0, 3),
        "files": files,
    }
    write_json_atomic(os.path.join(output_dir, REPORT_NAME), report, fsync=True)
    dest.publish([f["output"] for f in files.values()] + [REPORT_NAME])
    return report


def _extracted(runner, items: list[Part], settings: ExtractSettings, progress: bool):
    """Each part's result, in order, with a progress bar: of records when the parts run here one after the other
    (one process), else of parts."""
    from tqdm import tqdm  # tqdm costs ~50 ms at import: mtnlg-extract --help stays without it

    if runner.cpus == 1 and runner.name == "local":
        bar = tqdm(desc="extract", unit=" records", disable=not progress)
        yield from (extract_part(settings, item, lambda: bar.update(1)) for item in items)
    else:
        bar = tqdm(total=len(items), desc="extract", unit="part", disable=not progress)
        for result in runner.map(extract_part, items, settings):
            bar.update(1)
            yield result
    bar.close()


def _write_shard(path: str, parts: list[dict]) -> None:
    """One input's shard: the documents of its parts, in record order, written atomically."""
    lines = sorted((line for r in parts for line in r["lines"]), key=lambda x: x[0])
    with atomic_write(path, "wb", fsync=True) as f:
        for _, line in lines:
            f.write(line)


def _tally(counts) -> dict:
    """The records, documents, outcomes, languages, pages without main text and policy lines of several parts
    (of a file) or files (of the run), added up."""
    outcomes: Counter = Counter()
    languages: Counter = Counter()
    lost_languages: Counter = Counter()
    for c in counts:
        outcomes.update(c["outcomes"])
        languages.update(c["languages"])
        lost_languages.update(c["no_main_text_languages"])
    return {
        "records": sum(outcomes.values()),
        "documents": outcomes.get("ok", 0),
        "outcomes": dict(sorted(outcomes.items())),
        "languages": dict(languages.most_common()),
        "no_main_text_languages": dict(_by_count(lost_languages)),
        "policy_lines_removed": sum(c["policy_lines_removed"] for c in counts),
    }


def _by_count(counts: Counter) -> list[tuple[str, int]]:
    """Most first, ties by name: the same order however the parts were split."""
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
