#!/usr/bin/env python
"""Tokenize a JSONL corpus into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx), EOD after each document.

python tools/preprocess_data.py --input corpus.jsonl --tokenizer tok/tokenizer.json --output-prefix data/corpus
"""

import argparse
import sys

import _bootstrap  # noqa: F401

from mtnlg_lightning.curation.cli_common import int_at_least
from mtnlg_lightning.data.preprocess import preprocess_jsonl
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.outputs import check_input_file, check_output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="preprocess_data.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", required=True, help="JSONL file, one document per line")
    parser.add_argument("--json-key", default="text", help="field of each JSON record holding the text (default: text)")
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="tokenizer.json, or a directory with tokenizer.json or vocab.json + merges.txt",
    )
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx (atomically)")
    parser.add_argument("--workers", type=int_at_least(1), default=1, help="tokenizer processes (default: 1)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    try:
        check_input_file(args.input)
        for suffix in (".bin", ".idx"):  # never over the input or the tokenizer
            check_output(args.output_prefix + suffix, [args.input, args.tokenizer], replaces_dir=False)
        summary = preprocess_jsonl(
            args.input,
            args.tokenizer,
            args.output_prefix,
            args.json_key,
            args.workers,
            progress=not args.no_progress,
        )
    except MTNLGError as error:
        print(f"preprocess_data: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_prefix}.bin/.idx: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
