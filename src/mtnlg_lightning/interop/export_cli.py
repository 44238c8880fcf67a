"""`mtnlg-export-hf CHECKPOINT OUTPUT_DIR`: a checkpoint as a Hugging Face GPT-2 directory (also tools/export_hf.py).

The directory loads offline with `transformers.AutoModelForCausalLM.from_pretrained(OUTPUT_DIR)` and
`AutoTokenizer.from_pretrained(OUTPUT_DIR)`.
"""

from __future__ import annotations

import argparse
import os
import sys

from mtnlg_lightning.errors import MTNLGError, one_line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtnlg-export-hf",
        description="Export a checkpoint (any layout) to a Hugging Face GPT-2 directory: config.json, "
        "model.safetensors (vocabulary trimmed to the tokenizer's, LM head tied), tokenizer files and "
        "generation_config.json (<|endoftext|> as bos/eos). Written to a temporary directory, then renamed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", help="a project checkpoint (a .ckpt file or checkpoint folder)")
    p.add_argument("output_dir", help="the directory to write (must not exist or be empty, unless --overwrite)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="dtype of the saved weights")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json or directory to ship with the model (default: the one the checkpoint names)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from mtnlg_lightning.interop.hf import export_hf, read_source
        from mtnlg_lightning.outputs import check_output

        # OUT is replaced whole: never the checkpoint, its folder or a parent of it, the tokenizer's, ., ~ or /.
        check_output(args.output_dir, [args.checkpoint, args.tokenizer], replaces_dir=True)
        if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
            raise MTNLGError(f"{args.output_dir} is a file; name a directory to write the model in")
        state = read_source(args.checkpoint)
        check_output(args.output_dir, [state.tokenizer], replaces_dir=True)
        summary = export_hf(state, args.output_dir, args.dtype, args.tokenizer, args.overwrite)
    except MTNLGError as error:
        print(f"mtnlg-export-hf: error: {one_line(error)}", file=sys.stderr)
        return 2
    print(
        f"wrote {summary['output']}: GPT-2, {state.config.num_layers} layers, hidden {state.config.hidden_size}, "
        f"{summary['parameters']:,} parameters in {summary['dtype']}, vocabulary {summary['vocab_size']}"
    )
    if summary["tokenizer"] is None:
        print(
            "note: the checkpoint names no tokenizer, so none was written; re-run with --tokenizer PATH, or copy "
            "tokenizer.json into the directory before loading it with AutoTokenizer",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
