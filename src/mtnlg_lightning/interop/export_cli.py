"""`mtnlg-export-hf CHECKPOINT OUTPUT_DIR`: a checkpoint as a Hugging Face directory of the family its config names
(`model.family`: GPT-2, Llama, Qwen 2, Qwen 3, and the mixtures of experts Qwen 3-MoE, Qwen 2-MoE, Mixtral, OLMoE,
DeepSeek-V3, GLM-4.5; Gemma 3, GPT-OSS and Qwen3-Next); a checkpoint written before configs named their family gets
it from its options when read (`config.config_from_stored`), a custom block (family null) has no Hugging Face form.

The directory loads offline with `transformers.AutoModelForCausalLM.from_pretrained(OUTPUT_DIR)` and
`AutoTokenizer.from_pretrained(OUTPUT_DIR)`.
"""

from __future__ import annotations

import argparse
import os
import sys

from mtnlg_lightning.errors import MTNLGError, run_main
from mtnlg_lightning.extras import require_extra
from mtnlg_lightning.quick_exit import skip_final_garbage_collection


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtnlg-export-hf",
        description="Export a checkpoint (any layout) to a Hugging Face directory of the family its config names "
        "(model.family: GPT-2, Llama, Qwen 2, Qwen 3, Qwen 3-MoE, Qwen 2-MoE, Mixtral, OLMoE, DeepSeek-V3, GLM-4.5, "
        "Gemma 3, GPT-OSS or Qwen3-Next: architectures, RoPE settings, tied or untied head): config.json, "
        "model.safetensors or its shards model-0000k-of-0000n.safetensors with model.safetensors.index.json "
        "(vocabulary trimmed to the tokenizer's), tokenizer files with the chat template the checkpoint carries "
        "(chat_template.jinja and its special tokens) and generation_config.json (eos: the end of the "
        "assistant's turn and <|endoftext|>; without a template <|endoftext|> as bos/eos). The weights are read "
        "and written a slice at a time (memory: a few shards, whatever the model size), to a temporary directory, "
        "then renamed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", help="a project checkpoint (a .ckpt file or checkpoint folder)")
    p.add_argument("output_dir", help="the directory to write (must not exist or be empty, unless --overwrite)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="dtype of the saved weights")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json or directory to ship with the model (default: the one the checkpoint names); a "
        "directory with a chat template brings it",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest weights file, as Hugging Face's save_pretrained: bytes or a size (100MB, 5GB, 2GiB); one "
        "model.safetensors when the model fits one shard, a tensor larger than this gets a shard of its own",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument(
        "--adapter",
        action="store_true",
        help="of a LoRA run's checkpoint, write the adapter as a PEFT directory (adapter_config.json and "
        "adapter_model.safetensors, which peft and vLLM load on the base; the tokenizer files and chat template "
        "beside them) instead of the merged model",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    skip_final_garbage_collection()  # quick_exit.py: a quicker exit
    args = build_parser().parse_args(argv)

    def body() -> int:
        require_extra("hf", "mtnlg-export-hf")  # before the checkpoint is read
        # After the extra check: these import torch (seconds), and outputs json (~4 ms of a ~70 ms `--help`), so
        # `--help` or a missing extra answers at once.
        from mtnlg_lightning.checkpoint.safetensors_shards import parse_size
        from mtnlg_lightning.interop.hf import export_hf, read_source
        from mtnlg_lightning.outputs import check_output

        parse_size(args.max_shard_size)  # a bad size is one line before the checkpoint is read
        # OUT is replaced whole: never the checkpoint, its folder or a parent of it, the tokenizer's, ., ~ or /.
        check_output(args.output_dir, [args.checkpoint, args.tokenizer], replaces_dir=True)
        if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
            raise MTNLGError(f"{args.output_dir} is a file; name a directory to write the model in")
        if args.adapter:
            return _export_adapter(args)
        state = read_source(args.checkpoint)  # a LoRA run's: its base with the adapters merged (fp32)
        check_output(args.output_dir, [state.tokenizer], replaces_dir=True)
        summary = export_hf(
            state, args.output_dir, args.dtype, args.tokenizer, args.overwrite, max_shard_size=args.max_shard_size
        )
        print(
            f"wrote {summary['output']}: {summary['family']}, {state.config.num_layers} layers, "
            f"hidden {state.config.hidden_size}, "
            f"{summary['parameters']:,} parameters in {summary['dtype']} ({summary['bytes'] / 1e6:,.1f} MB in "
            f"{summary['shards']} shard{'s' if summary['shards'] > 1 else ''}), vocabulary {summary['vocab_size']}"
            f"{_tokenizer_note(summary)}"
        )
        if summary["tokenizer"] is None:
            print(
                "note: the checkpoint names no tokenizer, so none was written; re-run with --tokenizer PATH, or copy "
                "tokenizer.json into the directory before loading it with AutoTokenizer",
                file=sys.stderr,
            )
        return 0

    return run_main("mtnlg-export-hf", body)


def _tokenizer_note(summary: dict) -> str:
    if not summary["tokenizer"]:
        return ""
    return ", with its tokenizer and chat template" if summary["chat_template"] else ", with its tokenizer"


def _export_adapter(args) -> int:
    # torch (seconds), as in main: --help stays without it
    from mtnlg_lightning.checkpoint import read_model_state
    from mtnlg_lightning.interop.hf import is_hf_dir
    from mtnlg_lightning.interop.peft_adapter import write_peft_adapter

    state = None if is_hf_dir(args.checkpoint) else read_model_state(args.checkpoint)
    if state is None or state.lora is None:
        raise MTNLGError(
            f"{args.checkpoint} holds no LoRA adapter (--adapter exports a --model.lora run's checkpoint); "
            f"without --adapter the whole model is written"
        )
    summary = write_peft_adapter(state, args.output_dir, args.dtype, args.overwrite, args.tokenizer)
    print(
        f"wrote {summary['output']}: a PEFT LoRA adapter of {summary['base']} ({', '.join(summary['target_modules'])}; "
        f"{summary['parameters']:,} parameters in {summary['tensors']} tensors, {args.dtype})"
        f"{_tokenizer_note(summary)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
