"""``mtnlg-extract``: WARC/WET files to JSON lines of text with their language."""

from __future__ import annotations

import argparse
import sys

from mtnlg_lightning.config import fields_from
from mtnlg_lightning.corpora.cli_args import URLS_HELP
from mtnlg_lightning.corpora.cli_common import (
    add_engine_args,
    add_output_dir_arg,
    add_quiet_arg,
    check_engine_args,
    positive_int,
    run_job,
    tool_parser,
)
from mtnlg_lightning.crawl.extract import EXTRACTORS, NO_MAIN_TEXT, ExtractSettings, run_extract
from mtnlg_lightning.extras import require_extra

PROG = "mtnlg-extract"


def _languages(value: str) -> tuple[str, ...]:
    codes = tuple(sorted({c.strip().lower() for c in value.split(",") if c.strip()}))
    bad = [c for c in codes if not (c.isalpha() and len(c) in (2, 3))]
    if not codes or bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated ISO 639-1 codes such as en,de, got {value!r}")
    return codes


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(
        PROG,
        (
            "Turn Common Crawl WARC (HTML responses) or WET (extracted text) files into JSON lines, one output shard "
            "OUT/<input name>.jsonl per input, each line {id, url, date, text, language, language_score}: HTML to "
            "text with trafilatura (datatrove's default) or jusText (NeMo-Curator's; its stop words those of the "
            "languages of the page's prose, named by pyCLD2 from its paragraphs, not its markup); the language "
            "(ISO 639-1) of the text kept, by pyCLD2. A page of which the extractor keeps nothing is "
            "counted as no_main_text, by language, and reported at the end. Records that fail to read, decode or "
            "parse are counted by reason in OUT/extract_report.json, never fatal; non-HTML payloads and non-2xx "
            "responses are counted and passed over. Output is the same bytes whatever --workers and --engine."
        ),
    )
    p.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="WARC or WET files, gzip (.warc.gz) or plain, " + URLS_HELP
    )
    add_output_dir_arg(
        p,
        "directory for the JSONL shards and extract_report.json (created if missing; shards are replaced atomically)",
    )
    p.add_argument(
        "--extractor",
        choices=EXTRACTORS,
        default=EXTRACTORS[0],
        help="HTML to text: 'trafilatura' (datatrove's default, and ours: on a crawl in 15 languages it kept every "
        "page, benchmarks/bench_crawl_languages.py) or 'justext' (NeMo-Curator's default: no boilerplate left, "
        "but it drops a page whose paragraphs are all short, counted as no_main_text)",
    )
    p.add_argument(
        "--languages",
        type=_languages,
        default=(),
        metavar="en,de,...",
        help="keep only documents identified as one of these ISO 639-1 codes (the others are counted as "
        "language_not_kept); default: keep every language",
    )
    p.add_argument(
        "--min-chars",
        type=positive_int,
        default=1,
        help="drop (as no_text) a page whose extracted text has fewer characters",
    )
    p.add_argument(
        "--keep-policy-lines",
        action="store_true",
        help="keep the lines C4 removes after extraction (naming a cookie policy, privacy policy or terms of use, "
        "or asking for JavaScript; English phrases); removed by default and counted in the report",
    )
    add_engine_args(p, "extraction (one input is split by record number into up to 8 tasks, ~2 per worker)")
    add_quiet_arg(p)
    return p


def format_summary(report: dict) -> str:
    outcomes = report["outcomes"]
    dropped = {k: v for k, v in outcomes.items() if k != "ok" and not k.startswith("skipped_")}
    skipped = sum(v for k, v in outcomes.items() if k.startswith("skipped_"))
    langs = ", ".join(f"{k} {v}" for k, v in list(report["languages"].items())[:8]) or "-"
    lines = [
        f"mtnlg-extract: {report['inputs']} file(s), {report['records']} records in {report['seconds']:.1f} s "
        f"({report['engine']}, {report['workers']} worker(s))",
        f"  documents  {report['documents']} written",
        f"  skipped    {skipped} non-page records (warcinfo, request, metadata, revisit)",
        f"  dropped    {sum(dropped.values())}"
        + (": " + ", ".join(f"{k} {v}" for k, v in dropped.items()) if dropped else ""),
        f"  languages  {langs}",
        f"  lines      {report['policy_lines_removed']} cookie/privacy/JavaScript lines removed (C4's rule)",
    ]
    lost = report.get("no_main_text_languages") or {}
    if lost:
        other = "trafilatura" if report["settings"]["extractor"] == "justext" else "justext"
        lines.append(
            f"  no text    {sum(lost.values())} pages whose every paragraph {report['settings']['extractor']} judged "
            "boilerplate, by the language of their prose: "
            + ", ".join(f"{k} {v}" for k, v in list(lost.items())[:12])
            + f" (counted as {NO_MAIN_TEXT}; --extractor {other} judges differently)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_engine_args(args, parser)
    settings = fields_from(ExtractSettings, args, policy_lines=args.keep_policy_lines)

    def extract() -> dict:
        require_extra("crawl", PROG)
        if args.extractor == "trafilatura":
            require_extra("trafilatura", f"{PROG} --extractor trafilatura")
        return run_extract(
            args.inputs,
            args.output_dir,
            settings,
            workers=args.workers,
            engine=args.engine,
            ray_address=args.ray_address,
            progress=not args.quiet,
        )

    outputs = f"{args.output_dir}/ (one .jsonl per input, extract_report.json)"
    return run_job(PROG, extract, format_summary, lambda report: outputs)


if __name__ == "__main__":
    sys.exit(main())
