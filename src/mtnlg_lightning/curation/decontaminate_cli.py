"""``mtnlg-decontaminate``: remove downstream-task n-grams from training data."""

from __future__ import annotations

import argparse
import sys

from mtnlg_lightning.config import fields_from
from mtnlg_lightning.corpora.cli_args import (
    FORMATS_HELP,
    OUTPUT_URL_HELP,
    URLS_HELP,
    add_bad_record_arg,
    add_output_compression_arg,
)
from mtnlg_lightning.corpora.cli_common import (
    add_engine_args,
    add_quiet_arg,
    add_shard_arg,
    add_text_key_arg,
    check_engine_args,
    non_negative_int,
    positive_int,
    run_job,
    tool_parser,
)
from mtnlg_lightning.corpora.records import format_bad
from mtnlg_lightning.curation.decontaminate import DecontamConfig, run_decontaminate

PROG = "mtnlg-decontaminate"


DESCRIPTION = (
    "Remove downstream-task text from training data (MT-NLG / Megatron-LM filter_ngrams.py semantics): 13-word task "
    "n-grams (8-12 word task texts used whole) are searched in the lowercased \\w+ words of every document; n-grams "
    "found in >= --frequent-threshold documents are ignored as common phrases; each match is removed with --window "
    "characters on each side, extended to the nearest sentence end, and the document is split there. Writes "
    "--output (one input file) or, with --output-dir, one output per input file under its name (a folder's files "
    "keep their paths below it), in the input's format, each atomically; n-grams are counted over all inputs "
    "together; report.json last, its hits naming file and line."
)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(PROG, DESCRIPTION)
    _add_files_args(p)
    add_text_key_arg(p)
    p.add_argument("--id-key", default="id", help="JSON key with a document id, quoted in the report's hit list")
    _add_matching_args(p)
    add_engine_args(p, "both passes")
    add_shard_arg(p, 8, "training-file shard (MB) a task")
    add_quiet_arg(p)
    return p


def _add_files_args(p: argparse.ArgumentParser) -> None:
    """The task files, the training data, what is written for it and where the report goes."""
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


def _add_matching_args(p: argparse.ArgumentParser) -> None:
    """Which task n-grams are searched, and what a match removes."""
    p.add_argument("--max-ngram", type=positive_int, default=13, help="n-gram length in words taken from task texts")
    p.add_argument(
        "--min-ngram",
        type=positive_int,
        default=8,
        help="task texts of --min-ngram..--max-ngram-1 words are used whole; shorter ones are ignored",
    )
    p.add_argument(
        "--window",
        type=non_negative_int,
        default=200,
        help="characters removed on each side of a match before extending to the nearest sentence end",
    )
    p.add_argument(
        "--min-piece",
        type=non_negative_int,
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


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> DecontamConfig:
    if args.min_ngram > args.max_ngram:
        parser.error("--min-ngram must not exceed --max-ngram")
    check_engine_args(args, parser)
    return fields_from(DecontamConfig, args, shard_bytes=args.shard_mb << 20, progress=not args.quiet)


def format_summary(report: dict) -> str:
    d = report["documents"]
    s = report["settings"]
    t = report["tasks"]
    lines = [
        "mtnlg-decontaminate summary",
        f"  tasks      {sum(t['task_texts'].values())} texts from {len(t['task_texts'])} tasks -> {t['ngrams']} n-grams"
        f" (by length {t['ngrams_by_length']})",
        f"  frequent   {report['frequent_ngrams']['ignored']} n-grams in >= {s['frequent_threshold']}"
        " documents ignored",
        f"  documents  {d['in']} in -> {d['records_out']} records out: {d['clean']} clean, {d['trimmed']} trimmed,"
        f" {d['split']} split, {d['dropped_too_many_splits']} dropped (> {s['max_splits']} pieces),"
        f" {d['dropped_no_piece_left']} dropped (no piece > {s['min_piece']} chars)",
        f"  removed    {d['matches_removed']} matches, {d['chars_removed']} chars",
    ]
    if d.get("bad_records_skipped"):
        lines.append(f"  bad        {format_bad(report['bad_records'])}")
    per = report["hits"]["per_task"]
    if per:
        lines.append("  per task   " + ", ".join(f"{k}: {v['documents']} docs" for k, v in per.items()))
    tm = report["timings_s"]
    lines.append(
        f"  time       tasks {tm['load_tasks']:.2f}s  count {tm['count_pass']:.2f}s  clean {tm['clean_pass']:.2f}s"
        f"  -> {report['mb_per_s']} MB/s ({report['mb_per_s_per_worker']} MB/s per worker)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cfg = config_from_args(parser.parse_args(argv), parser)

    def outputs(report: dict) -> str:
        shown = cfg.output or f"{cfg.output_dir}/ ({len(report['settings']['outputs'])} file(s), one per input)"
        return f"{shown}, {cfg.report_path()}"

    return run_job(PROG, lambda: run_decontaminate(cfg), format_summary, outputs)


if __name__ == "__main__":
    sys.exit(main())
