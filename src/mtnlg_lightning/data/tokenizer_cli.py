"""Train a GPT-2-style byte-level BPE tokenizer (with <|endoftext|>) on corpus text; writes tokenizer.json.

mtnlg-train-tokenizer --input corpus.jsonl --vocab-size 50257 --output tok/
"""

import argparse
import sys
import time

from mtnlg_lightning.corpora.cli_args import INPUTS_HELP, add_bad_record_arg
from mtnlg_lightning.corpora.cli_common import int_at_least
from mtnlg_lightning.corpora.commit import check_output
from mtnlg_lightning.corpora.records import format_bad
from mtnlg_lightning.corpora.sources import expand_inputs
from mtnlg_lightning.data.preprocess import read_texts
from mtnlg_lightning.data.tokenizer import train_bpe
from mtnlg_lightning.errors import MTNLGError, run_main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="mtnlg-train-tokenizer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", required=True, nargs="+", help=INPUTS_HELP)
    parser.add_argument(
        "--text-key", "--json-key", dest="json_key", default="text", help="field holding the text (default: text)"
    )
    parser.add_argument(
        "--vocab-size", type=int_at_least(2), default=50257, help="vocabulary size incl. <|endoftext|> (GPT-2: 50257)"
    )
    parser.add_argument(
        "--min-frequency", type=int_at_least(1), default=2, help="minimum pair count for a merge (default: 2)"
    )
    parser.add_argument(
        "--output",
        required=True,
        help="output tokenizer.json path, or a directory to hold it; a path or a URL (s3://bucket/tok)",
    )
    add_bad_record_arg(parser)
    args = parser.parse_args(argv)
    start = time.perf_counter()

    def body() -> int:
        for file in expand_inputs(args.input):
            check_output(args.output, [file.path], replaces_dir=False)
        texts, bad = read_texts(args.input, args.json_key, args.on_bad_record)
        if not texts:
            raise MTNLGError("the input holds no documents")
        tokenizer = train_bpe(texts, args.vocab_size, args.output, args.min_frequency)
        skipped = f"; {format_bad(bad)}" if sum(bad.values()) else ""
        print(
            f"trained a {tokenizer.vocab_size}-token byte-level BPE on {len(texts):,} documents "
            f"in {time.perf_counter() - start:.1f} s -> {args.output}{skipped}"
        )
        return 0

    return run_main("mtnlg-train-tokenizer", body)


if __name__ == "__main__":
    sys.exit(main())
