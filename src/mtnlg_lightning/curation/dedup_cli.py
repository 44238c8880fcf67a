"""``mtnlg-dedup``: fuzzy deduplication of JSONL corpora."""

from __future__ import annotations

import argparse
import sys

from mtnlg_lightning.config import fields_from
from mtnlg_lightning.corpora.cli_args import INPUTS_HELP, add_bad_record_arg, add_output_compression_arg
from mtnlg_lightning.corpora.cli_common import (
    add_engine_args,
    add_output_dir_arg,
    add_quiet_arg,
    add_shard_arg,
    add_text_key_arg,
    check_engine_args,
    number_where,
    positive_int,
    run_job,
    tool_parser,
)
from mtnlg_lightning.corpora.records import format_bad
from mtnlg_lightning.curation.dedup import DedupConfig, run_dedup
from mtnlg_lightning.curation.lsh import DEFAULT_BANDING, DEFAULT_MAX_NEIGHBORS, MTNLG_BANDING, Banding
from mtnlg_lightning.curation.minhash import SCHEMES
from mtnlg_lightning.curation.shingles import ShingleSpec

PROG = "mtnlg-dedup"


def _shingle(value: str) -> ShingleSpec:
    try:
        return ShingleSpec.parse(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_threshold = number_where("a number in (0, 1]", lambda v: 0.0 < v <= 1.0)


DESCRIPTION = (
    "Remove exact and near-duplicate documents from corpora (MT-NLG recipe): exact duplicates of the normalised "
    "text first, then MinHash LSH with explicit bands x rows, candidate pairs verified by exact Jaccard >= "
    "--threshold, clusters by union-find, one document kept per cluster. Writes OUT/<input name> (kept records, "
    "unchanged, same order, in the input's format; a folder's files keep their paths below it), "
    "OUT/duplicates.jsonl and OUT/report.json. Inputs are never modified; a killed run re-run with the same "
    "arguments resumes."
)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(PROG, DESCRIPTION)
    _add_corpus_args(p)
    _add_similarity_args(p)
    p.add_argument(
        "--priority",
        default=None,
        metavar="IN2.jsonl,IN.jsonl",
        help="comma-separated inputs, highest priority first: a cluster keeps its document from the "
        "highest-priority input (unlisted inputs follow in command-line order); ties go to the "
        "first occurrence",
    )
    add_engine_args(p, "every stage")
    _add_minhash_args(p)
    _add_run_args(p)
    return p


def _add_corpus_args(p: argparse.ArgumentParser) -> None:
    """What is read and written: the inputs, OUT, the record keys, bad records, the outputs' compression."""
    p.add_argument("inputs", nargs="+", metavar="INPUT", help=INPUTS_HELP)
    add_output_dir_arg(p, "directory for the deduplicated files, duplicates.jsonl and report.json (created if missing)")
    add_text_key_arg(p)
    p.add_argument(
        "--id-key",
        default="id",
        help="JSON key with a document id, used in duplicates.jsonl (absent: FILE:LINE is used)",
    )
    add_bad_record_arg(p)
    add_output_compression_arg(p)


def _add_similarity_args(p: argparse.ArgumentParser) -> None:
    """When two documents are duplicates, and how candidates are found: threshold, LSH banding, shingles."""
    p.add_argument(
        "--threshold",
        type=_threshold,
        default=0.8,
        help="exact Jaccard similarity (on the shingle sets) at or above which two documents are duplicates",
    )
    p.add_argument(
        "--num-bands",
        type=positive_int,
        default=None,
        help=f"LSH bands b (default {DEFAULT_BANDING.bands}); permutations = b x r",
    )
    p.add_argument(
        "--rows-per-band",
        type=positive_int,
        default=None,
        help=f"LSH rows per band r (default {DEFAULT_BANDING.rows}); P(candidate|J) = 1-(1-J^r)^b",
    )
    p.add_argument(
        "--preset",
        choices=["default", "mtnlg"],
        default="default",
        help="'mtnlg': the paper's 20 bands x 13 rows (260 permutations); cannot be combined with "
        "--num-bands/--rows-per-band. 'default': 32 x 8, which meets the recall targets at J=0.8",
    )
    p.add_argument(
        "--shingle",
        type=_shingle,
        default=ShingleSpec("word", 5),
        metavar="word:K|char:N",
        help="shingles: K-word windows of the lowercased, punctuation-stripped words, or N-character "
        "windows of the lowercased, whitespace-collapsed text",
    )


def _add_minhash_args(p: argparse.ArgumentParser) -> None:
    """The MinHash permutations and the candidate pairs' bounds."""
    p.add_argument("--seed", type=int, default=1, help="seed of the MinHash permutations (datasketch MinHash seed)")
    p.add_argument(
        "--scheme",
        choices=list(SCHEMES),
        default="affine32",
        help="datasketch MinHash permutation scheme: 'affine32' (datasketch>=2 default) or 'legacy' "
        "(a*h+b mod 2^61-1, datasketch<2)",
    )
    p.add_argument(
        "--max-bucket-neighbors",
        type=positive_int,
        default=DEFAULT_MAX_NEIGHBORS,
        help="inside one LSH bucket each document is paired with this many following members (all pairs "
        "for buckets up to this size + 1); bounds the work on huge buckets",
    )
    p.add_argument(
        "--estimate-margin",
        type=float,
        default=0.1,
        help="candidate pairs whose MinHash-estimated Jaccard is below threshold minus this margin are "
        "rejected without computing the exact Jaccard (a pair at the threshold is lost with "
        "probability < 1e-4 at 256 permutations); a negative value verifies every candidate exactly",
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """How the run goes: shards, a clean start, the work files, progress."""
    add_shard_arg(p, 16, "input shard (MB) a signature task")
    p.add_argument(
        "--force",
        action="store_true",
        help="start clean even if OUT holds a finished or resumable run with the same inputs and settings",
    )
    p.add_argument(
        "--keep-work",
        action="store_true",
        help="keep the stage files in OUT/.dedup-work after success (for inspection; for an output URL, in its "
        "local scratch folder under $MTNLG_CACHE/scratch)",
    )
    add_quiet_arg(p)


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> DedupConfig:
    check_engine_args(args, parser)
    if args.preset == "mtnlg":
        if args.num_bands is not None or args.rows_per_band is not None:
            parser.error("--preset mtnlg fixes 20 bands x 13 rows; do not combine it with --num-bands/--rows-per-band")
        banding = MTNLG_BANDING
    else:
        banding = Banding(args.num_bands or DEFAULT_BANDING.bands, args.rows_per_band or DEFAULT_BANDING.rows)
    priority = [x.strip() for x in args.priority.split(",") if x.strip()] if args.priority else None
    return fields_from(
        DedupConfig,
        args,
        banding=banding,
        priority=priority,
        shard_bytes=args.shard_mb << 20,
        max_neighbors=args.max_bucket_neighbors,
        progress=not args.quiet,
    )


def format_summary(report: dict) -> str:
    t = report["totals"]
    p = report["pairs"]
    s = report["settings"]
    b = report["banding"]
    lines = [
        "mtnlg-dedup " + ("(already complete, nothing to do)" if report.get("already_complete") else "summary"),
        f"  settings   threshold {s['threshold']}  {b['bands']} bands x {b['rows_per_band']} rows"
        f" ({s['num_perm']} perms)"
        f"  shingle {s['shingle']}  scheme {s['scheme']}  seed {s['seed']}",
        "  P(cand)    " + "  ".join(f"J={j}: {v:.3f}" for j, v in b["candidate_probability"].items()),
    ]
    bad = report.get("bad_records") or {}
    if sum(bad.values()):
        lines.append(f"  bad        {format_bad(bad)}")
    for x in report["inputs"]:
        lines.append(
            f"  {x['file']}: {x['docs_in']} in, {x['docs_out']} out"
            f" (-{x['exact_duplicates_removed']} exact, -{x['near_duplicates_removed']} near)"
        )
    c = report["clusters"]
    lines += [
        f"  total      {t['docs_in']} in, {t['docs_out']} out, removed {t['exact_duplicates_removed']} exact"
        f" + {t['near_duplicates_removed']} near duplicates",
        f"  clusters   {c['clusters']} (docs in clusters {c['docs_in_clusters']}, largest {c['largest_cluster']})",
        f"  pairs      {p['candidate_pairs']} candidates ({p['rejected_by_estimate']} rejected by estimate),"
        f" {p['jaccard_computed']} exact Jaccard computed,"
        f" {p['verified_pairs']} verified, {p['rejected_pairs']} rejected",
        "  time       "
        + "  ".join(f"{k} {v:.2f}s" for k, v in report["timings_s"].items())
        + f"  total {report['total_s']:.2f}s  ({report['docs_per_s']} docs/s)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cfg = config_from_args(parser.parse_args(argv), parser)
    outputs = f"{cfg.output_dir}/ (report.json, duplicates.jsonl, deduplicated inputs)"
    return run_job(PROG, lambda: run_dedup(cfg), format_summary, lambda report: outputs)


if __name__ == "__main__":
    sys.exit(main())
