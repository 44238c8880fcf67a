#!/usr/bin/env python
"""Extraction in every language, the extractors side by side in one run on the same pages: which one is the default
of `mtnlg-extract` is chosen by these figures.

    python benchmarks/bench_crawl_languages.py                  # 3 crawls: 100 English + 14 languages x 8 pages each
    python benchmarks/bench_crawl_languages.py --seeds 1 --english-pages 20 --pages-per-language 4   # quicker

The crawls (synthetic/warc.py): English articles (the standard library's docstrings) in a real site's
boilerplate; pages in 14 other languages (de fr es it nl pt pl ru zh ja ar tr ko sv) of one to four paragraphs,
every other one in the English site's template; junk pages. Each extractor runs on the same decoded HTML pages in
this process (CPU seconds by time.process_time), then C4's policy-line rule and pyCLD2 on the text kept, as
mtnlg-extract does:
  justext_from_markup   jusText as mtnlg-extract ran it before: the stop-word list of the one language pyCLD2
                        names from the whole HTML, jusText's own lengths
  justext               mtnlg-extract's default: the stop words of the languages of the page's prose, lengths
                        weighted for Chinese, Japanese and Korean (crawl/html_text.py)
  trafilatura           mtnlg-extract --extractor trafilatura
  datatrove_trafilatura datatrove's Trafilatura extractor (its extract(), no sandbox process), when installed
Scored against the planted truth: non-English pages kept with the right language, English pages kept, article
words kept (of every page: a page lost loses its words), boilerplate words left, junk pages let through (for the
quality stage), the pages of which nothing was kept by the language of their prose.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import Counter

from results import benchmark_args, benchmark_parser, write_result  # noqa: E402

from mtnlg_lightning.crawl.extract import decode_html, drop_policy_lines  # noqa: E402
from mtnlg_lightning.crawl.html_text import page_text, prose_languages, segment  # noqa: E402
from mtnlg_lightning.crawl.language import identify_language, stoplist_for  # noqa: E402
from mtnlg_lightning.crawl.warc import BrokenRecord, iter_records  # noqa: E402
from mtnlg_lightning.demo.synthetic.warc import (  # noqa: E402
    ALL_LANGUAGES,
    CrawlSpec,
    score_extraction,
    write_synthetic_warc,
)


def html_pages(path: str) -> list[tuple[str, str]]:
    """(url, decoded HTML) of every HTML response of a WARC file."""
    pages = []
    for _, record in iter_records(path):
        if isinstance(record, BrokenRecord) or record.rec_type != "response":
            continue
        content_type = record.http_headers.get_header("Content-Type") or ""
        if "html" in content_type:
            html = decode_html(record.content_stream().read(), content_type)
            if html is not None:
                pages.append((record.rec_headers.get_header("WARC-Target-URI"), html))
    return pages


def justext_from_markup(html: str) -> str:
    """mtnlg-extract's jusText before this benchmark: one stop-word list, of pyCLD2's language of the HTML."""
    import justext

    code, _, name = identify_language(html, html=True)
    stoplist = stoplist_for(code, name)
    kwargs = {} if stoplist else {"stopwords_low": 0.0, "stopwords_high": 0.0}
    return "\n\n".join(p.text for p in justext.justext(html, stoplist, **kwargs) if not p.is_boilerplate)


def extractors() -> dict:
    out = {
        "justext_from_markup": justext_from_markup,
        "justext": lambda html: page_text(html, "justext").text,
        "trafilatura": lambda html: page_text(html, "trafilatura").text,
    }
    try:
        from datatrove.pipeline.extractors import Trafilatura

        peer = Trafilatura()
        out["datatrove_trafilatura"] = lambda html: peer.extract(html) or ""
    except ImportError:
        pass
    return out


def measure(name: str, extract, pages: list[tuple[str, str]], truth: list[dict]) -> dict:
    c0 = time.process_time()
    texts = [(url, extract(html)) for url, html in pages]
    cpu = time.process_time() - c0
    docs, lost, html_of = [], Counter(), dict(pages)
    for url, text in texts:
        text = drop_policy_lines(text)[0].strip()
        if text:
            docs.append({"url": url, "text": text, "language": identify_language(text)[0]})
        else:  # the page's language as mtnlg-extract reports it
            languages = prose_languages(segment(html_of[url]))
            lost[languages[0][0] if languages else "un"] += 1
    foreign = [t for t in truth if t["kind"] == "page" and t["language"] != "en"]
    english = [t for t in truth if t["kind"] == "page" and t["language"] == "en"]
    f, e, every = (score_extraction(part, docs) for part in (foreign, english, truth))
    junk = {t["url"] for t in truth if t["kind"] == "junk"}
    by_language = Counter(t["language"] for t in foreign)
    kept_right = Counter(t["language"] for t in foreign if t["url"] not in f["missing"]) - Counter(
        expected for _, expected, _ in f["wrong_language"]
    )
    return {
        "non_english_pages_kept_right_language": (f["pages_found"] - len(f["wrong_language"])) / f["pages"],
        "english_pages_kept": e["pages_found"] / e["pages"],
        "article_words_kept": every["article_words_kept"],
        "boilerplate_words_left": every["boilerplate_words_left"],
        "junk_pages_let_through": sum(d["url"] in junk for d in docs) / max(1, len(junk)),
        "pages_per_cpu_s": len(pages) / cpu if cpu > 0 else float("nan"),
        "no_text_by_language": dict(sorted(lost.items())),
        "worst_languages": {
            lang: round(kept_right[lang] / n, 3) for lang, n in sorted(by_language.items()) if kept_right[lang] < n
        },
    }


def main() -> None:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--seeds", type=int, default=3, help="crawls (seeds 0..N-1), pooled")
    ap.add_argument("--english-pages", type=int, default=100, help="English pages per crawl")
    ap.add_argument("--pages-per-language", type=int, default=8, help="pages per other language per crawl")
    args = benchmark_args(ap)

    pages, truth = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            warc = os.path.join(tmp, f"crawl{seed}.warc.gz")
            spec = CrawlSpec(
                english_pages=args.english_pages,
                pages_per_language=args.pages_per_language,
                junk_pages=args.english_pages // 10,
                seed=seed,
                broken_records=False,
                languages=ALL_LANGUAGES,
                foreign_template="alternate",
                foreign_paragraphs=(1, 4),
            )
            truth += write_synthetic_warc(warc, spec)
            pages += html_pages(warc)
    kinds = Counter(t["kind"] if t["kind"] != "page" else f"page_{t['language'] == 'en'}" for t in truth)
    figures = {
        "crawl": {
            "seeds": args.seeds,
            "english_pages": kinds["page_True"],
            "non_english_pages": kinds["page_False"],
            "languages": len(ALL_LANGUAGES),
            "junk_pages": kinds["junk"],
            "html_pages": len(pages),
        },
        "extractors": {name: measure(name, fn, pages, truth) for name, fn in extractors().items()},
    }
    print(json.dumps(figures, indent=1))
    rows = [
        ("non-English pages kept, right language", "non_english_pages_kept_right_language", ">= 0.95"),
        ("English pages kept", "english_pages_kept", ""),
        ("article words kept (every page)", "article_words_kept", ">= 0.95"),
        ("boilerplate words left", "boilerplate_words_left", "<= 0.05"),
        ("junk pages let through", "junk_pages_let_through", ""),
        ("HTML pages per CPU-second", "pages_per_cpu_s", ""),
    ]
    names = list(figures["extractors"])
    print("\n| figure | " + " | ".join(names) + " | target |")
    print("|---|" + "---|" * len(names) + "---|")
    for label, key, target in rows:
        cells = [figures["extractors"][n][key] for n in names]
        fmt = "{:.0f}" if key == "pages_per_cpu_s" else "{:.3f}"
        print(f"| {label} | " + " | ".join(fmt.format(c) for c in cells) + f" | {target} |")
    write_result(args.json, figures)


if __name__ == "__main__":
    main()
