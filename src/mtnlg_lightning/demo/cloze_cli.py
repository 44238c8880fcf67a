"""Build the demo's offline LAMBADA-format cloze set ({"text": passage} per line) from held-out demo text.

    mtnlg-make-cloze-set --output data/demo_cloze.jsonl [--count 200]

The passages come from the documents of the demo corpus' validation and test splits (data.split 969,30,1, as the
trainer splits them), so the demo model never trained on them. Evaluate with
`mtnlg-eval --checkpoint CKPT --task lambada --data data/demo_cloze.jsonl --shots 0 1 5`.
"""

import argparse
import json
import sys

from mtnlg_lightning.data.gpt_dataset import split_ranges
from mtnlg_lightning.demo.builtin_corpus import build_demo_data
from mtnlg_lightning.demo.synthetic.cloze import cloze_passages
from mtnlg_lightning.demo.synthetic.demo_corpus import demo_dir
from mtnlg_lightning.outputs import atomic_write


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="mtnlg-make-cloze-set", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--output", required=True, help="the jsonl file to write (atomically)")
    p.add_argument("--count", type=int, default=200, help="passages at most")
    p.add_argument("--split", default="969,30,1", help="the trainer's data.split: held-out = valid + test documents")
    p.add_argument("--min-words", type=int, default=20, help="shortest passage in words (default: %(default)s)")
    p.add_argument("--max-words", type=int, default=80, help="longest passage in words (default: %(default)s)")
    args = p.parse_args(argv)
    build_demo_data(progress=False)
    with open(demo_dir() / "python_docs.jsonl", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    _, (valid_start, _), (_, test_end) = split_ranges(len(docs), args.split)
    passages = cloze_passages(docs[valid_start:test_end], args.count, args.min_words, args.max_words)

    with atomic_write(args.output, "w") as f:
        for passage in passages:
            f.write(json.dumps({"text": passage}) + "\n")
    print(f"wrote {len(passages)} passages from {test_end - valid_start} held-out documents to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
