"""``mtnlg-make-near-dup-corpus``: write a labelled near-duplicate corpus (and its ground truth)."""

from __future__ import annotations

import argparse
import json
import sys

from mtnlg_lightning.corpora.cli_common import INTERRUPTED, positive_int, tool_parser
from mtnlg_lightning.corpora.jsonl import atomic_write, dumps_line
from mtnlg_lightning.curation.shingles import ShingleSpec
from mtnlg_lightning.demo.synthetic.near_duplicates import ground_truth_pairs, make_near_dup_corpus
from mtnlg_lightning.errors import run_main


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(
        "mtnlg-make-near-dup-corpus",
        (
            "Generate English-like documents (Zipf vocabulary) in families of near-duplicates with known edits "
            "(substitutions/insertions/deletions, boilerplate, excerpts, paragraph shuffles, exact copies). Each "
            "record has id, text, family and edit; --truth writes the exact Jaccard of every within-family pair."
        ),
    )
    p.add_argument("--docs", type=positive_int, default=10000, help="number of documents")
    p.add_argument("--output", "-o", required=True, metavar="CORPUS.jsonl", help="where to write the corpus")
    p.add_argument(
        "--truth",
        default=None,
        metavar="PAIRS.jsonl",
        help='optional ground truth: one {"a": id, "b": id, "jaccard": J} per within-family pair',
    )
    p.add_argument("--shingle", default="word:5", help="shingling used for the ground-truth Jaccard")
    p.add_argument("--doc-chars", type=positive_int, default=3600, help="mean document length in characters")
    p.add_argument("--dup-fraction", type=float, default=0.3, help="fraction of documents that are variants")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        recs = make_near_dup_corpus(args.docs, seed=args.seed, doc_chars=args.doc_chars, dup_fraction=args.dup_fraction)
        with atomic_write(args.output) as f:
            for r in recs:
                f.write(dumps_line(r))
        print(f"wrote {len(recs)} documents to {args.output}")
        if args.truth:
            pairs = ground_truth_pairs(recs, ShingleSpec.parse(args.shingle))
            with atomic_write(args.truth, "w") as f:
                for i, j, jv in pairs:
                    f.write(json.dumps({"a": recs[i]["id"], "b": recs[j]["id"], "jaccard": round(jv, 6)}) + "\n")
            print(f"wrote {len(pairs)} within-family pairs to {args.truth}")
        return 0

    return run_main("mtnlg-make-near-dup-corpus", body, INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
