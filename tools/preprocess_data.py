#!/usr/bin/env python
"""Tokenize a JSONL corpus into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx), EOD after each document.

python tools/preprocess_data.py --input corpus.jsonl --tokenizer tok/tokenizer.json --output-prefix data/corpus
"""

import argparse
import sys

import _bootstrap  # noqa: F401

from mtnlg_lightning.data.preprocess import preprocess_jsonl
from mtnlg_lightning.errors import MTNLGError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="JSONL file, one document per line")
    parser.add_argument("--json-key", default="text", help="field of each JSON record holding the text (default: text)")
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="tokenizer.json, or a directory with tokenizer.json or vocab.json + merges.txt",
    )
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx (atomically)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    try:
        summary = preprocess_jsonl(
            args.input,
            args.tokenizer,
            args.output_prefix,
            args.json_key,
            max(1, args.workers),
            progress=not args.no_progress,
        )
    except MTNLGError as error:
        print(f"preprocess_data: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_prefix}.bin/.idx: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
