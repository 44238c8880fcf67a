"""The scores of the crawl stages against the truth of the planted crawl (synthetic/planted_crawl.py): extraction,
the language filter and the quality filter, as precision and recall.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

SHARD = "crawl.jsonl"  # mtnlg-extract's output shard for the planted WARC, kept under this name by every later tool
_WORD = re.compile(r"\w+", re.UNICODE)


def read_documents(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def precision_recall(selected: set, relevant: set) -> dict:
    """Precision and recall of a selection against the relevant set (1.0 when a side is empty: nothing wrong)."""
    hit = len(selected & relevant)
    return {
        "precision": round(hit / len(selected), 4) if selected else 1.0,
        "recall": round(hit / len(relevant), 4) if relevant else 1.0,
        "selected": len(selected),
        "relevant": len(relevant),
    }


def _words(text: str) -> Counter:
    return Counter(_WORD.findall(text.lower()))


def score_extraction(truth: list[dict], documents: list[dict]) -> dict:
    """Documents: the planted pages (every language) against the documents extracted (junk let through lowers the
    precision: the quality stage is there for it). Words, over the planted pages found (their titles aside, a
    heading is kept by design): recall = share of the body's words kept, precision = share of the words out that
    are body words; and the share of boilerplate words left."""
    urls = {d["url"] for d in documents}
    has_text = {t["url"] for t in truth if t["kind"] == "page"}
    by_url = {d["url"]: d for d in documents}
    body_total = body_kept = out_total = boiler_total = boiler_left = 0
    for t in truth:
        if t["kind"] != "page" or t["url"] not in by_url:
            continue
        got = _words(by_url[t["url"]]["text"]) - _words(t["title"])
        body, boiler = _words(" ".join(t["body"])), _words(t["boilerplate"])
        kept = got & body
        body_total, body_kept, out_total = body_total + body.total(), body_kept + kept.total(), out_total + got.total()
        boiler_total, boiler_left = boiler_total + boiler.total(), boiler_left + ((got - body) & boiler).total()
    return {
        "documents": precision_recall(urls, has_text),
        "body_words": {
            "precision": round(body_kept / max(1, out_total), 4),
            "recall": round(body_kept / max(1, body_total), 4),
        },
        "boilerplate_words_left": round(boiler_left / max(1, boiler_total), 4),
    }


def score_language(truth: list[dict], documents_in: list[dict], documents_out: list[dict]) -> dict:
    """Over the planted pages that reached the filter: English pages kept (relevant = the English ones); and the
    identification accuracy on every page in (the language named by extraction = the planted one)."""
    pages = {t["url"]: t for t in truth if t["kind"] == "page"}
    into = [d for d in documents_in if d["url"] in pages]
    kept = {d["url"] for d in documents_out if d["url"] in pages}
    english = {d["url"] for d in into if pages[d["url"]]["language"] == "en"}
    right = sum(d["language"] == pages[d["url"]]["language"] for d in into)
    junk = {t["url"] for t in truth if t["kind"] == "junk"}
    return {
        "english_pages": precision_recall(kept, english),
        "identification_accuracy": round(right / max(1, len(into)), 4),
        "junk_passed": sum(d["url"] in junk for d in documents_out),
    }


def score_quality(truth: list[dict], documents_in: list[dict], documents_out: list[dict]) -> dict:
    """Planted pages (real prose) against junk: the pages kept (precision: share of the kept that are pages;
    recall: share of the pages in that are kept), and the junk dropped."""
    kind = {t["url"]: t["kind"] for t in truth}
    into = {d["url"] for d in documents_in}
    kept = {d["url"] for d in documents_out}
    pages_in = {u for u in into if kind.get(u) == "page"}
    junk_in = into - pages_in
    return {
        "pages_kept": precision_recall(kept, pages_in),
        "junk_dropped": precision_recall(into - kept, junk_in),
    }


def corpus_ids(truth: list[dict]) -> dict[str, str]:
    """url -> corpus document id, for the pages made from the corpus."""
    return {t["url"]: t["id"] for t in truth if t["kind"] == "page" and "id" in t}
