#!/usr/bin/env python
"""Crawl benchmark: documents per CPU-second of each stage from WARC to scored text, ours and datatrove's side by
side on the same WARC file in one run, with extraction accuracy against the planted truth.

    python benchmarks/bench_crawl.py                       # 3 synthetic crawls of 100 English pages + 28 foreign
    python benchmarks/bench_crawl.py --copies 1 --english-pages 40 --json out.json   # quicker

Stages (each in this process, CPU time by time.process_time):
  read       WARC records to decoded HTML: our reader (warcio + resync) vs datatrove's WarcReader
  extract    HTML to text (+ C4's policy-line rule, as mtnlg-extract does by default): ours with jusText (+ pyCLD2
             on the page's prose for its stop words), ours with trafilatura (mtnlg-extract's default),
             datatrove's Trafilatura extractor (its extract(), without the per-document sandbox process)
  language   pyCLD2 on the extracted text (datatrove's LanguageFilter needs a fastText model download: noted, not run)
  filters    our Gopher/C4 rules (one measuring pass, every rule) vs datatrove's GopherQuality, GopherRepetition and
             C4Quality filters, each and together (they need spaCy's tokenizer; noted when missing)
  classifier our hashed n-gram logistic regression, scoring
  end to end mtnlg-extract (1 worker) on the whole file: records per CPU-second
The WARC has no broken records: datatrove's WarcReader stops a file at the first corrupt gzip member (zlib.error).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from results import benchmark_args, benchmark_parser, write_result  # noqa: E402

from mtnlg_lightning.crawl import heuristics  # noqa: E402
from mtnlg_lightning.crawl.classifier import train  # noqa: E402
from mtnlg_lightning.crawl.extract import ExtractSettings, decode_html, drop_policy_lines, run_extract  # noqa: E402
from mtnlg_lightning.crawl.html_text import page_text  # noqa: E402
from mtnlg_lightning.crawl.language import identify_language  # noqa: E402
from mtnlg_lightning.crawl.warc import BrokenRecord, iter_records  # noqa: E402
from mtnlg_lightning.demo.synthetic.warc import (  # noqa: E402
    CrawlSpec,
    junk_documents,
    score_extraction,
    write_synthetic_warc,
)

# One Common Crawl snapshot (CC-MAIN-2024-10, from its announcement): 3.16 billion pages, 424.7 TiB uncompressed.
SNAPSHOT_PAGES = 3.16e9
SNAPSHOT_BYTES = 424.7 * 2**40


def timed(fn, *args):
    c0 = time.process_time()
    result = fn(*args)
    return result, time.process_time() - c0


def rate(n, seconds):
    return n / seconds if seconds > 0 else float("nan")


def build_warc(path: str, copies: int, english_pages: int) -> list[dict]:
    truth = []
    with open(path, "wb") as out:
        for seed in range(copies):
            part = f"{path}.{seed}"
            truth += write_synthetic_warc(part, CrawlSpec(english_pages=english_pages, seed=seed, broken_records=False))
            with open(part, "rb") as f:
                out.write(f.read())  # gzip members concatenate into one valid WARC
            os.remove(part)
            os.remove(f"{part}.truth.jsonl")
    return truth


def our_read(path: str) -> list[tuple[str, str, str | None]]:
    """(url, content type, decoded HTML or None) of every response: the same work as datatrove's reader, which
    decodes each payload to text too."""
    pages = []
    for _, record in iter_records(path):
        if isinstance(record, BrokenRecord) or record.rec_type != "response":
            continue
        content_type = record.http_headers.get_header("Content-Type") or ""
        html = decode_html(record.content_stream().read(), content_type) if "html" in content_type else None
        pages.append((record.rec_headers.get_header("WARC-Target-URI"), content_type, html))
    return pages


def datatrove_read(path: str) -> list:
    from datatrove.pipeline.readers import WarcReader

    reader = WarcReader(os.path.dirname(path), glob_pattern=os.path.basename(path))
    return list(reader.run(None, 0, 1))


def datatrove_filters() -> dict:
    from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter, GopherRepetitionFilter

    return {
        "gopher_quality": GopherQualityFilter(),
        "gopher_repetition": GopherRepetitionFilter(),
        "c4": C4QualityFilter(),
    }


def main() -> None:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--copies", type=int, default=3, help="synthetic crawls (different seeds) in the one WARC file")
    ap.add_argument("--english-pages", type=int, default=100, help="English pages per synthetic crawl")
    args = benchmark_args(ap)

    figures: dict = {"notes": []}
    with tempfile.TemporaryDirectory() as tmp:
        warc = os.path.join(tmp, "crawl.warc.gz")
        truth = build_warc(warc, args.copies, args.english_pages)
        figures["warc_mb"] = os.path.getsize(warc) / 1e6
        figures["records"] = len(truth) + args.copies  # + one warcinfo per copy

        # read
        pages, cpu = timed(our_read, warc)
        figures["read"] = {"ours_docs_per_cpu_s": rate(len(pages), cpu)}
        html_pages = [(url, html) for url, _, html in pages if html]
        html_bytes = sum(len(h.encode("utf-8")) for _, h in html_pages)
        figures["html_pages"], figures["html_kb_per_page"] = len(html_pages), html_bytes / len(html_pages) / 1e3
        try:
            docs, cpu = timed(datatrove_read, warc)
            figures["read"]["datatrove_docs_per_cpu_s"] = rate(len(docs), cpu)
        except ImportError as err:
            figures["notes"].append(f"datatrove reader not run: {err}")

        # extract
        def ours_justext():
            return [
                {"url": url, "text": drop_policy_lines(page_text(html, "justext").text)[0]} for url, html in html_pages
            ]

        def trafilatura_ours():
            return [
                {"url": url, "text": drop_policy_lines(page_text(html, "trafilatura").text)[0]}
                for url, html in html_pages
            ]

        def datatrove_trafilatura():
            from datatrove.pipeline.extractors import Trafilatura

            extractor = Trafilatura()
            return [{"url": url, "text": extractor.extract(html) or ""} for url, html in html_pages]

        extract = {}
        for name, fn in (
            ("ours_justext", ours_justext),
            ("ours_trafilatura", trafilatura_ours),
            ("datatrove_trafilatura", datatrove_trafilatura),
        ):
            try:
                texts, cpu = timed(fn)
            except ImportError as err:
                figures["notes"].append(f"{name} not run: {err}")
                continue
            for d in texts:
                d["language"] = identify_language(d["text"])[0] if d["text"] else "un"
            found = [d for d in texts if d["text"]]
            acc = score_extraction(truth, found)
            extract[name] = {
                "docs_per_cpu_s": rate(len(html_pages), cpu),
                "mb_per_cpu_s": html_bytes / 1e6 / cpu,
                "pages_found": acc["pages_found"],
                "pages": acc["pages"],
                "body_words_kept": acc["body_words_kept"],
                "boilerplate_words_left": acc["boilerplate_words_left"],
            }
            if name == "ours_justext":
                extracted = found
        figures["extract"] = extract

        # language identification
        texts = [d["text"] for d in extracted]
        _, cpu = timed(lambda: [identify_language(t) for t in texts])
        figures["language"] = {"ours_cld2_docs_per_cpu_s": rate(len(texts), cpu)}
        figures["notes"].append("datatrove LanguageFilter (fastText lid.176 / GlotLID) downloads its model: not run")

        # filters
        settings = heuristics.rule_settings()
        _, cpu = timed(lambda: [heuristics.failed_rules(heuristics.measure(t), settings) for t in texts])
        filters = {"ours_all_rules_docs_per_cpu_s": rate(len(texts), cpu)}
        try:
            from datatrove.data import Document

            documents = [Document(text=t, id=str(i)) for i, t in enumerate(texts)]
            peers = datatrove_filters()
            peers["gopher_quality"].filter(documents[0])  # loads the tokenizer outside the timing
            total = 0.0
            for name, f in peers.items():
                _, cpu = timed(lambda f=f: [f.filter(d) for d in documents])
                filters[f"datatrove_{name}_docs_per_cpu_s"] = rate(len(documents), cpu)
                total += cpu
            filters["datatrove_all_three_docs_per_cpu_s"] = rate(len(documents), total)
        except ImportError as err:
            figures["notes"].append(f"datatrove filters not run: {' '.join(str(err).split())}")
        figures["filters"] = filters

        # classifier
        model = train(texts, junk_documents(len(texts), seed=1))
        _, cpu = timed(lambda: model.scores(texts))
        figures["classifier"] = {"ours_docs_per_cpu_s": rate(len(texts), cpu)}

        # end to end
        report, cpu = timed(lambda: run_extract([warc], os.path.join(tmp, "out"), ExtractSettings(), progress=False))
        figures["end_to_end"] = {
            "ours_records_per_cpu_s": rate(report["records"], cpu),
            "ours_mb_per_cpu_s": figures["warc_mb"] / cpu,
        }

    e2e = figures["end_to_end"]["ours_records_per_cpu_s"]
    per_byte = figures["extract"]["ours_justext"]["mb_per_cpu_s"]
    figures["snapshot_projection"] = {
        "cpu_hours_by_pages": SNAPSHOT_PAGES / e2e / 3600,
        "cpu_hours_by_html_bytes": SNAPSHOT_BYTES / 1e6 / per_byte / 3600,
        # pages: at our end-to-end rate on these small pages (a lower bound); bytes: every uncompressed byte of the
        # snapshot (requests and metadata too) at jusText's HTML MB per CPU-second (an upper bound)
        "basis": "CC-MAIN-2024-10, 3.16e9 pages, 424.7 TiB uncompressed",
    }
    print(json.dumps(figures, indent=1))
    write_result(args.json, figures)


if __name__ == "__main__":
    main()
