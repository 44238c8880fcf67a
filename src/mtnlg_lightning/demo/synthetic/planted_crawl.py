"""The crawl in front of the pipeline: the planted corpus served as a web crawl, with its truth.

Every document of the raw corpus (synthetic/planted_corpus.py: real prose with planted duplicates and planted task
text) becomes an English page of a WARC file, its paragraphs wrapped in a site's boilerplate (synthetic/warc.py);
beside them go pages in seven other languages, junk pages, non-HTML payloads, redirects and broken records. The
truth (what each record is, and for a page its corpus id, language, body and boilerplate) is written beside the
WARC, so the pipeline's report can score extraction, the language filter and the quality filter against it
(pipeline/crawl.py).

The classifier of the quality stage is trained, as GPT-3's, on curated text (positives: prose paragraphs of the
standard library's docstrings, as a curated source would supply) against raw-crawl junk (negatives), generated
with seeds other than the crawl's.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mtnlg_lightning.demo.synthetic.planted_corpus import PARAGRAPH_BREAK, write_jsonl
from mtnlg_lightning.demo.synthetic.warc import CrawlSpec as WarcSpec
from mtnlg_lightning.demo.synthetic.warc import english_paragraphs, junk_documents, write_synthetic_warc

WARC_NAME = "crawl.warc.gz"


@dataclass
class CrawlSpec:
    """What the crawl adds around the corpus pages. The defaults are the full pipeline's; `smoke()` is the reduced
    run's (`mtnlg-pipeline --smoke`)."""

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
    """The truth `build_crawl` wrote beside the WARC, one dict per record."""
    with open(out / "raw" / (WARC_NAME + ".truth.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]
