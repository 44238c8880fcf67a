"""``mtnlg-dedup``: fuzzy deduplication of JSONL corpora."""

from __future__ import annotations

import argparse
import sys

from mtnlg_lightning.corpora.cli_args import INPUTS_HELP, add_bad_record_arg, add_output_compression_arg
from mtnlg_lightning.corpora.cli_common import (
    INTERRUPTED,
    add_engine_args,
    add_output_dir_arg,
    add_quiet_arg,
    add_text_key_arg,
    check_engine_args,
    positive_int,
    tool_parser,
)
from mtnlg_lightning.curation.dedup import DedupConfig, format_summary, run_dedup
from mtnlg_lightning.curation.lsh import DEFAULT_BANDING, DEFAULT_MAX_NEIGHBORS, MTNLG_BANDING, Banding
from mtnlg_lightning.curation.minhash import SCHEMES
from mtnlg_lightning.curation.shingles import ShingleSpec
from mtnlg_lightning.errors import run_main

PROG = "mtnlg-dedup"


def _shingle(value: str) -> ShingleSpec:
    try:
        return ShingleSpec.parse(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _threshold(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value!r}") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(
        PROG,
        (
            "Remove exact and near-duplicate documents from corpora (MT-NLG recipe): exact duplicates of the "
            "normalised text first, then MinHash LSH with explicit bands x rows, candidate pairs verified by exact "
            "Jaccard >= --threshold, clusters by union-find, one document kept per cluster. Writes OUT/<input "
            "name> (kept records, unchanged, same order, in the input's format; a folder's files keep their paths "
            "below it), OUT/duplicates.jsonl and OUT/report.json. Inputs are "
            "never modified; a killed run re-run with the same arguments resumes."
        ),
    )
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
    p.add_argument(
        "--priority",
        default=None,
        metavar="IN2.jsonl,IN.jsonl",
        help="comma-separated inputs, highest priority first: a cluster keeps its document from the "
        "highest-priority input (unlisted inputs follow in command-line order); ties go to the "
        "first occurrence",
    )
    add_engine_args(p, "every stage")
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
    p.add_argument(
        "--shard-mb",
        type=positive_int,
        default=16,
        help="largest input shard (MB) a signature task processes and a resumed run skips when finished; small "
        "inputs get smaller shards (>= 1 MB), about 4 per CPU",
    )
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
    return p


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> DedupConfig:
    check_engine_args(args, parser)
    if args.preset == "mtnlg":
        if args.num_bands is not None or args.rows_per_band is not None:
            parser.error("--preset mtnlg fixes 20 bands x 13 rows; do not combine it with --num-bands/--rows-per-band")
        banding = MTNLG_BANDING
    else:
        banding = Banding(args.num_bands or DEFAULT_BANDING.bands, args.rows_per_band or DEFAULT_BANDING.rows)
    priority = [x.strip() for x in args.priority.split(",") if x.strip()] if args.priority else None
    return DedupConfig(
        inputs=args.inputs,
        output_dir=args.output_dir,
        text_key=args.text_key,
        id_key=args.id_key,
        threshold=args.threshold,
        banding=banding,
        shingle=args.shingle,
        scheme=args.scheme,
        seed=args.seed,
        priority=priority,
        workers=args.workers,
        engine=args.engine,
        ray_address=args.ray_address,
        shard_bytes=args.shard_mb << 20,
        max_neighbors=args.max_bucket_neighbors,
        estimate_margin=args.estimate_margin,
        progress=not args.quiet,
        keep_work=args.keep_work,
        force=args.force,
        preset=args.preset,
        on_bad_record=args.on_bad_record,
        output_compression=args.output_compression,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args, parser)

    def body() -> int:
        report = run_dedup(cfg)
        print(format_summary(report))
        print(f"  outputs    {cfg.output_dir}/ (report.json, duplicates.jsonl, deduplicated inputs)")
        return 0

    return run_main(PROG, body, INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
