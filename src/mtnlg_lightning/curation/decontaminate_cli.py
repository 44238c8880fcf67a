"""``mtnlg-decontaminate``: remove downstream-task n-grams from training data."""

from __future__ import annotations

import argparse
import sys

from mtnlg_lightning.corpora.cli_args import (
    FORMATS_HELP,
    OUTPUT_URL_HELP,
    URLS_HELP,
    add_bad_record_arg,
    add_output_compression_arg,
)
from mtnlg_lightning.corpora.cli_common import (
    INTERRUPTED,
    add_engine_args,
    add_quiet_arg,
    add_text_key_arg,
    check_engine_args,
    int_at_least,
    positive_int,
    tool_parser,
)
from mtnlg_lightning.curation.decontaminate import DecontamConfig, format_summary, run_decontaminate
from mtnlg_lightning.errors import run_main

PROG = "mtnlg-decontaminate"


_non_negative = int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(
        PROG,
        (
            "Remove downstream-task text from training data (MT-NLG / Megatron-LM filter_ngrams.py semantics): "
            "13-word task n-grams (8-12 word task texts used whole) are searched in the lowercased \\w+ words of "
            "every document; n-grams found in >= --frequent-threshold documents are ignored as common phrases; each "
            "match is removed with --window characters on each side, extended to the nearest sentence end, and the "
            "document is split there. Writes --output (one input file) or, with --output-dir, one output per input "
            "file under its name (a folder's files keep their paths below it), in the input's format, each "
            "atomically; n-grams are counted over all inputs together; report.json last, its hits naming file and "
            "line."
        ),
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        required=True,
        metavar="TASKS.jsonl",
        help='task files, folders or globs, records {"task": name, "text": ...} ("task" defaults to the file name '
        "without suffixes), " + URLS_HELP + "; " + FORMATS_HELP,
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="TRAIN",
        help="training data: one file with --output; any number of files, folders or globs with --output-dir; "
        + URLS_HELP
        + "; "
        + FORMATS_HELP,
    )
    add_bad_record_arg(p)
    add_output_compression_arg(p)
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument(
        "--output",
        metavar="OUT.jsonl",
        help="decontaminated records of the one input file: the source fields, text replaced by each piece, plus "
        "split_id; " + OUTPUT_URL_HELP,
    )
    out.add_argument(
        "--output-dir",
        metavar="OUT",
        help="one output per input file, OUT/<input name> (a folder's files keep their paths below it), as --output",
    )
    p.add_argument(
        "--report",
        default=None,
        metavar="REPORT.json",
        help="where to write the report, a path or a URL (default: report.json in the output's directory)",
    )
    add_text_key_arg(p)
    p.add_argument("--id-key", default="id", help="JSON key with a document id, quoted in the report's hit list")
    p.add_argument("--max-ngram", type=positive_int, default=13, help="n-gram length in words taken from task texts")
    p.add_argument(
        "--min-ngram",
        type=positive_int,
        default=8,
        help="task texts of --min-ngram..--max-ngram-1 words are used whole; shorter ones are ignored",
    )
    p.add_argument(
        "--window",
        type=_non_negative,
        default=200,
        help="characters removed on each side of a match before extending to the nearest sentence end",
    )
    p.add_argument(
        "--min-piece",
        type=_non_negative,
        default=200,
        help="pieces of a split document with this many characters or fewer are dropped",
    )
    p.add_argument(
        "--max-splits",
        type=positive_int,
        default=10,
        help="a document left in more than this many pieces is dropped entirely",
    )
    p.add_argument(
        "--frequent-threshold",
        type=positive_int,
        default=10,
        help="task n-grams found in at least this many training documents are ignored (common phrases)",
    )
    add_engine_args(p, "both passes")
    p.add_argument(
        "--shard-mb",
        type=positive_int,
        default=8,
        help="largest training-file shard (MB) a task processes and a resumed run skips when finished; small "
        "inputs get smaller shards (>= 1 MB), about 4 per CPU",
    )
    add_quiet_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.min_ngram > args.max_ngram:
        parser.error("--min-ngram must not exceed --max-ngram")
    check_engine_args(args, parser)
    cfg = DecontamConfig(
        tasks=args.tasks,
        input=args.input,
        output=args.output,
        output_dir=args.output_dir,
        report=args.report,
        text_key=args.text_key,
        id_key=args.id_key,
        max_ngram=args.max_ngram,
        min_ngram=args.min_ngram,
        window=args.window,
        min_piece=args.min_piece,
        max_splits=args.max_splits,
        frequent_threshold=args.frequent_threshold,
        workers=args.workers,
        engine=args.engine,
        ray_address=args.ray_address,
        shard_bytes=args.shard_mb << 20,
        progress=not args.quiet,
        on_bad_record=args.on_bad_record,
        output_compression=args.output_compression,
    )

    def body() -> int:
        report = run_decontaminate(cfg)
        print(format_summary(report))
        outputs = report["settings"]["outputs"]
        shown = cfg.output or f"{cfg.output_dir}/ ({len(outputs)} file(s), one per input)"
        print(f"  outputs    {shown}, {cfg.report_path()}")
        return 0

    return run_main(PROG, body, INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
