"""Text generation with a KV cache: `generate(...)` from Python, `mtnlg-generate` on the command line.

    mtnlg-generate --checkpoint runs/demo/checkpoints/last.ckpt --prompt "Return the" --max-new-tokens 64

Works on a project checkpoint or a Hugging Face GPT-2 directory (loaded by `inference.load`). Decoding runs the
model's own forward with a `model.KVCache` (nanoGPT / litgpt style): the prompt is run once (prefill), its keys and
values cached per layer, so each new token costs one position instead of re-running the whole prefix.
"""

from __future__ import annotations

import argparse
import sys

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.inference.decode import generate
from mtnlg_lightning.inference.load import load_model, pick_device, pick_dtype, resolve_tokenizer
from mtnlg_lightning.inference.sampling import POSITIONS


# ------------------------------------------------------------------------------------------- the CLI
class TextStream:
    """Prints a sample's text as its tokens arrive; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, file=None):
        self.tokenizer, self.file, self.printed = tokenizer, file or sys.stdout, ""

    def __call__(self, sample: int, tokens: list[int]) -> None:
        text = self.tokenizer.decode(tokens)
        if not text.endswith("\ufffd"):
            self.file.write(text[len(self.printed) :])
            self.file.flush()
            self.printed = text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtnlg-generate",
        description="Generate text from a project checkpoint or a Hugging Face GPT-2 directory (KV cache; "
        "greedy at --temperature 0). The text streams to stdout; notes and the summary go to stderr.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, help="a project checkpoint or a Hugging Face GPT-2 directory")
    p.add_argument("--prompt", required=True, help="the text to continue; '-' reads prompts from stdin, one a line")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per sample at most")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (argmax)")
    p.add_argument("--top-k", type=int, default=None, help="sample only among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample only within this probability mass (nucleus)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the sampling (same seed, same text)")
    p.add_argument("--num-samples", type=int, default=1, help="continuations per prompt (one batch)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or directory, if the checkpoint names none")
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="auto: bf16 on GPU")
    p.add_argument(
        "--strategy",
        help="generate in a layout: a strategy YAML of `mtnlg fit` (TP, PP, schedule; DP = devices / (TP x PP)); "
        "all prompts (and samples) decode as one batch per replica, seeded once; output when all are done",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="local ranks to start (as `mtnlg fit --trainer.devices N`); under torchrun/srun, the launcher's world",
    )
    return p


def check_sampling(args) -> None:
    """Every numeric flag in range, before the model loads (one line each)."""
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise MTNLGError("--max-new-tokens and --num-samples must be at least 1")
    if not 0 <= args.temperature < float("inf"):
        raise MTNLGError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise MTNLGError(f"--top-k must be at least 1 (or left out), got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise MTNLGError(f"--top-p must be in (0, 1], got {args.top_p}")


def run(args) -> None:
    from mtnlg_lightning.inference.runs import read_prompts

    check_sampling(args)
    prompts = read_prompts(args.prompt)
    device = pick_device(args.device)
    model, state = load_model(args.checkpoint, device, pick_dtype(args.dtype, device), for_generation=True)
    tokenizer = resolve_tokenizer(state.tokenizer, args.tokenizer)
    made, seconds = 0, 0.0
    for n, prompt in enumerate(prompts):
        stream = TextStream(tokenizer) if args.num_samples == 1 else None
        if stream is not None:
            print(prompt, end="", flush=True)
        result = generate(
            model,
            tokenizer.encode(prompt),
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            args.top_p,
            args.num_samples,
            tokenizer.eod_id,
            args.seed + n,
            on_token=stream,
        )
        for i, tokens in enumerate(result.tokens):
            if stream is None:
                print(f"--- sample {i + 1} ---\n{prompt}{tokenizer.decode(tokens)}")
            else:
                print(tokenizer.decode(tokens)[len(stream.printed) :])
            if result.stop[i] == POSITIONS:
                print(f"[stopped at the position limit of {state.config.max_position_embeddings}]", file=sys.stderr)
        made += sum(len(t) for t in result.tokens)
        seconds += result.seconds
    print(
        f"mtnlg-generate: {made} tokens for {len(prompts)} prompt(s) in {seconds:.2f} s "
        f"({made / max(seconds, 1e-9):.1f} tokens/s) on {device} {str(model.embed.wte.weight.dtype)[6:]}",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    from mtnlg_lightning.inference.runs import command_main, run_generate

    return command_main("mtnlg-generate", build_parser(), run, run_generate, argv)


if __name__ == "__main__":
    sys.exit(main())
