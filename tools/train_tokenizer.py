#!/usr/bin/env python
"""Train a GPT-2-style byte-level BPE tokenizer (with <|endoftext|>) on JSONL text; writes tokenizer.json.

python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 50257 --output tok/
"""

import argparse
import sys
import time

import _bootstrap  # noqa: F401

from mtnlg_lightning.curation.cli_common import int_at_least
from mtnlg_lightning.data.preprocess import read_texts
from mtnlg_lightning.data.tokenizer import train_bpe
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.outputs import check_input_file, check_output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="train_tokenizer.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", required=True, nargs="+", help="JSONL file(s), one document per line")
    parser.add_argument("--json-key", default="text", help="field holding the text (default: text)")
    parser.add_argument(
        "--vocab-size", type=int_at_least(2), default=50257, help="vocabulary size incl. <|endoftext|> (GPT-2: 50257)"
    )
    parser.add_argument(
        "--min-frequency", type=int_at_least(1), default=2, help="minimum pair count for a merge (default: 2)"
    )
    parser.add_argument("--output", required=True, help="output tokenizer.json path, or a directory to hold it")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        for path in args.input:
            check_input_file(path)
            check_output(args.output, [path], replaces_dir=False)
        texts = [t for path in args.input for chunk, _ in read_texts(path, args.json_key) for t in chunk]
        if not texts:
            raise MTNLGError("the input holds no documents")
        tokenizer = train_bpe(texts, args.vocab_size, args.output, args.min_frequency)
    except MTNLGError as error:
        print(f"train_tokenizer: error: {error}", file=sys.stderr)
        return 2
    print(
        f"trained a {tokenizer.vocab_size}-token byte-level BPE on {len(texts):,} documents "
        f"in {time.perf_counter() - start:.1f} s -> {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
