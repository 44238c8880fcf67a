"""The crawl in front of the pipeline: the planted corpus served as a web crawl, and the scores of the crawl stages.

Every document of the raw corpus (pipeline/corpus.py: real prose with planted duplicates and planted task text)
becomes an English page of a WARC file, its paragraphs wrapped in a site's boilerplate (crawl/synthetic_warc.py);
beside them go pages in seven other languages, junk pages, non-HTML payloads, redirects and broken records. The
truth (what each record is, and for a page its corpus id, language, body and boilerplate) is written beside the
WARC, so the report can score extraction, the language filter and the quality filter against it.

The classifier of the quality stage is trained, as GPT-3's, on curated text (positives: prose paragraphs of the
standard library's docstrings, as a curated source would supply) against raw-crawl junk (negatives), generated
with seeds other than the crawl's.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mtnlg_lightning.pipeline.corpus import PARAGRAPH_BREAK, write_jsonl

WARC_NAME = "crawl.warc.gz"
SHARD = "crawl.jsonl"  # mtnlg-extract's output shard for WARC_NAME, carried under this name by every later tool
_WORD = re.compile(r"\w+", re.UNICODE)


@dataclass
class CrawlSpec:
    """What the crawl adds around the corpus pages."""

    junk_fraction: float = 0.15  # junk pages, as a share of the corpus pages
    pages_per_language: int = 4  # pages in each of the seven other languages
    classifier_documents: int = 150  # positives and (as many) negatives the quality classifier is trained on
    threshold: float = 0.5  # quality filter: keep when quality_score >= this and every heuristic rule passes ...
    # ... but Gopher's duplicate 5..10-gram rule: API documentation repeats its phrases ("this method", "the
    # record"), and the rule at Gopher's 0.15 drops ~40% of these real pages (the report counts every rule)
    disabled_rules: tuple[str, ...] = ("duplicate_ngrams",)

    @classmethod
    def smoke(cls) -> CrawlSpec:
        return cls(pages_per_language=2, classifier_documents=80)


def page_of(record: dict) -> dict:
    """A corpus document as a web page: its paragraphs become <p> elements, its module names the title."""
    module = record["id"].split("#")[0]
    body = [p.strip() for p in PARAGRAPH_BREAK.split(record["text"]) if p.strip()]
    return {"id": record["id"], "title": f"Notes on the {module} module", "body": body}


def build_crawl(out: Path, spec: CrawlSpec, seed: int) -> dict:
    """Write raw/crawl.warc.gz (+ .truth.jsonl) from raw/web.jsonl, and the classifier's training documents under
    quality/train/; return the summary the report shows."""
    from mtnlg_lightning.crawl.synthetic_warc import CrawlSpec as WarcSpec
    from mtnlg_lightning.crawl.synthetic_warc import english_paragraphs, junk_documents, write_synthetic_warc

    with open(out / "raw" / "web.jsonl", encoding="utf-8") as f:
        pages = [page_of(json.loads(line)) for line in f]
    warc = out / "raw" / WARC_NAME
    warc_spec = WarcSpec(
        pages_per_language=spec.pages_per_language, junk_pages=round(spec.junk_fraction * len(pages)), seed=seed
    )
    truth = write_synthetic_warc(warc, warc_spec, english_pages=pages)
    n = spec.classifier_documents
    prose = [p for _, p in english_paragraphs(4 * n)]
    positives = [{"text": "\n\n".join(prose[i : i + 4])} for i in range(0, len(prose), 4)]
    write_jsonl(out / "quality" / "train" / "positive.jsonl", positives)
    write_jsonl(out / "quality" / "train" / "negative.jsonl", [{"text": t} for t in junk_documents(n, seed + 1)])
    kinds = Counter(t["kind"] for t in truth)
    return {
        "records": len(truth),
        "bytes": warc.stat().st_size,
        "by_kind": dict(kinds),
        "english_pages": sum(t["kind"] == "page" and t["language"] == "en" for t in truth),
        "classifier_positives": len(positives),
        "classifier_negatives": n,
        "summary": [
            f"{kinds['page']} pages ({len(pages)} corpus documents), {kinds['junk']} junk, "
            f"{kinds['not_html'] + kinds['not_2xx']} non-HTML/non-2xx, {kinds['broken']} broken records"
        ],
    }


def read_truth(out: Path) -> list[dict]:
    with open(out / "raw" / (WARC_NAME + ".truth.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


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
