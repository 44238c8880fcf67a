"""Tokenize corpora into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx), EOD after each document; or merge
several PREFIX.bin/.idx pairs into one (--merge).

mtnlg-preprocess --input pile/train/ --tokenizer tok/ --output-prefix data/pile --workers 16
mtnlg-preprocess --merge data/part1 data/part2 --output-prefix data/all
"""

import argparse
import sys

from mtnlg_lightning.corpora.cli_args import INPUTS_HELP, add_bad_record_arg
from mtnlg_lightning.corpora.cli_common import int_at_least
from mtnlg_lightning.corpora.commit import check_output
from mtnlg_lightning.corpora.sources import expand_inputs
from mtnlg_lightning.errors import run_main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtnlg-preprocess", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--input", nargs="+", help=INPUTS_HELP)
    what.add_argument(
        "--merge",
        nargs="+",
        metavar="PREFIX",
        help="merge these datasets (PREFIX.bin/.idx, same token dtype) into --output-prefix, in this order, each "
        "one's document boundaries kept (Megatron's --split-sentences datasets: several sequences per document) "
        "and, when all are Megatron multimodal indexes, their per-sequence modes: the same bytes as Megatron-LM's "
        "tools/merge_datasets.py on a folder of them (it merges in sorted name order)",
    )
    parser.add_argument(
        "--text-key",
        "--json-key",
        dest="json_key",
        default="text",
        help="field of each record holding the text (default: text)",
    )
    parser.add_argument(
        "--tokenizer",
        help="tokenizer.json, or a directory with tokenizer.json or vocab.json + merges.txt (needed with --input); "
        "a path or a URL",
    )
    parser.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX.bin and PREFIX.idx (atomically); a URL (s3://bucket/data/pile) is written locally and "
        "committed there when complete, the .idx last",
    )
    parser.add_argument(
        "--workers",
        type=int_at_least(1),
        default=1,
        help="tokenizer processes; work is split by file and by 64 MB line-aligned ranges of plain JSON-lines files, "
        "and the output is the same bytes for any number (default: 1)",
    )
    add_bad_record_arg(parser)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.input and not args.tokenizer:
        parser.error("--input needs --tokenizer")

    def body() -> int:
        if args.merge:
            # the dataset readers, ~12 ms at import: only --merge needs them, --help and --input stay without
            from mtnlg_lightning.data.indexed import IndexedDataset
            from mtnlg_lightning.data.merge import merge_datasets

            for suffix in (".bin", ".idx"):  # never over a dataset being merged
                sources = [p + s for p in args.merge for s in (".bin", ".idx")]
                check_output(args.output_prefix + suffix, sources, replaces_dir=False)
            docs, tokens = merge_datasets(args.merge, args.output_prefix)
            merged = IndexedDataset(args.output_prefix)
            modes = ", with Megatron's multimodal modes" if merged.modes is not None else ""
            print(
                f"merged {len(args.merge)} datasets into {args.output_prefix}.bin/.idx: {docs:,} documents "
                f"({len(merged):,} sequences{modes}), {tokens:,} tokens"
            )
            return 0
        # tokenizers + tqdm, ~70 ms at import: --help and --merge stay without them
        from mtnlg_lightning.data.preprocess import preprocess

        inputs = [f.path for f in expand_inputs(args.input)]
        for suffix in (".bin", ".idx"):  # never over an input or the tokenizer
            check_output(args.output_prefix + suffix, [*inputs, args.tokenizer], replaces_dir=False)
        summary = preprocess(
            args.input,
            args.tokenizer,
            args.output_prefix,
            args.json_key,
            args.workers,
            progress=not args.no_progress,
            on_bad_record=args.on_bad_record,
        )
        print(f"wrote {args.output_prefix}.bin/.idx: {summary}")
        return 0

    return run_main("mtnlg-preprocess", body)


if __name__ == "__main__":
    sys.exit(main())
