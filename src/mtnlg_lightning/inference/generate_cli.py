"""`mtnlg-generate`: text from a project checkpoint or a Hugging Face model directory, in any layout.

    mtnlg-generate --checkpoint runs/demo/checkpoints/last.ckpt --prompt "Return the" --max-new-tokens 64
    mtnlg-generate --checkpoint CKPT --strategy configs/strategy/tp2_pp2_dp2.yaml --devices 8 --prompt - < prompts
    mtnlg-generate --checkpoint CKPT --chat --system "Answer briefly." --prompt "What is 12 + 7?" --temperature 0

Decoding runs the model's own forward with a KV cache (nanoGPT / litgpt style): the prompts are run once
(prefill), their keys and values cached per layer, so each new token costs one position instead of re-running the
whole prefix. Every prompt and sample decodes as one batch per data-parallel replica, each sample from its own
seeded generator: the same command prints the same text in every layout (and one process is the 1 x 1 x 1 one).
With `--chat` each prompt is a user turn in the model's chat template and only the assistant's answer is printed
(`inference.chat`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.inference.chat import Chat, chat_for
from mtnlg_lightning.inference.decode import decoding_of, generate_over_replicas
from mtnlg_lightning.inference.load import resolve_tokenizer
from mtnlg_lightning.inference.runs import run
from mtnlg_lightning.inference.sampling import POSITIONS
from mtnlg_lightning.shipped_configs import config_argument

PROMPTS_ENV = "MTNLG_GENERATE_PROMPTS"


class TextStream:
    """Prints a sample's text as its tokens arrive; holds back an incomplete UTF-8 character, and what `shown`
    leaves out of the text so far (a chat's end marker, or what may be its start)."""

    def __init__(self, decode, shown=None, file=None):
        self.decode, self.shown = decode, shown or (lambda text: text)
        self.file, self.printed = file or sys.stdout, ""

    def __call__(self, sample: int, tokens: list[int]) -> None:
        text = self.decode(tokens)
        if not text.endswith("\ufffd"):
            text = self.shown(text)
            self.file.write(text[len(self.printed) :])
            self.file.flush()
            self.printed = text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtnlg-generate",
        description="Generate text from a project checkpoint or a Hugging Face model directory (KV cache; greedy at "
        "--temperature 0), in one process or in a layout. The text goes to stdout (streamed as it is made when "
        "there is one prompt and one sample), the same in every layout; notes and the summary go to stderr.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, help="a project checkpoint (folder or .ckpt) or a Hugging Face model")
    p.add_argument("--prompt", required=True, help="the text to continue; '-' reads prompts from stdin, one a line")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per sample at most")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (argmax)")
    p.add_argument("--top-k", type=int, default=None, help="sample only among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample only within this probability mass (nucleus)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the sampling (same seed, same text, any layout)")
    p.add_argument("--num-samples", type=int, default=1, help="continuations per prompt")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or directory, if the checkpoint names none")
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user turn in the model's chat template (with its generation prompt); only the "
        "assistant's answer is printed, which ends at the end of its turn",
    )
    p.add_argument("--system", default=None, help="--chat: a system turn before each prompt")
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME|FILE|TEXT",
        help="--chat: this template instead of the model's (chatml, llama3, a .jinja file or the template text)",
    )
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="auto: bf16 on GPU")
    p.add_argument(
        "--strategy",
        type=config_argument("strategy"),
        help="generate in a layout: a strategy YAML of `mtnlg fit` (TP, PP, schedule; DP = devices / (TP x PP)); "
        "the prompts (and samples) are dealt over the data-parallel replicas",
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
    if not args.chat and (args.system is not None or args.chat_template is not None):
        raise MTNLGError("--system and --chat-template go with --chat")


def read_prompts(prompt: str) -> list[str]:
    """The prompts: `--prompt TEXT`, or the non-empty lines of stdin (`-`; UTF-8, else one line); ranks started by
    `--devices` cannot share the launcher's stdin, so it hands them the lines it read (JSON in an environment
    variable)."""
    if prompt != "-":
        return [prompt]
    if PROMPTS_ENV in os.environ:
        return json.loads(os.environ[PROMPTS_ENV])
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise MTNLGError(f"stdin is not UTF-8 text (byte {error.start} is {data[error.start]:#04x})") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise MTNLGError("--prompt -: stdin holds no prompt (one a line)")
    return prompts


def generate_and_print(args, prompts: list[str], model, plan, chat: Chat | None = None) -> None:
    """Decode every (prompt, sample) and print them on rank 0: a lone one streamed as `prompt + text`, several each
    under a `--- prompt N sample M ---` line. With `chat`, the prompts are user turns and the text is the answer
    alone."""
    samples = args.num_samples
    if chat is None:
        tokenizer = resolve_tokenizer(plan.source.tokenizer, args.tokenizer)
        ids, stops = [tokenizer.encode(p) for p in prompts], {"eos_id": tokenizer.eod_id}
        decode, shown, heads = tokenizer.decode, None, prompts
    else:
        ids = [chat.prompt_ids(p, args.system) for p in prompts]
        stops = {"eos_id": chat.end.ids, "stop_text": chat.stop_text()}
        decode, shown, heads = chat.tokenizer.decode, chat.end.shown, [""] * len(prompts)
    speaks = model.groups.rank == 0
    stream = TextStream(decode, shown) if speaks and len(prompts) * samples == 1 else None
    if stream is not None:
        print(heads[0], end="", flush=True)
    result = generate_over_replicas(
        model,
        [prompt for prompt in ids for _ in range(samples)],
        seed=args.seed,
        on_token=stream,
        **stops,
        **decoding_of(args),
    )
    if not speaks:
        return
    for n, tokens in enumerate(result.tokens):
        text = decode(tokens) if chat is None else chat.answer(tokens)
        if stream is not None:
            print(text[len(stream.printed) :])
        else:
            print(f"--- prompt {n // samples + 1} sample {n % samples + 1} ---\n{heads[n // samples]}{text}")
        if result.stop[n] == POSITIONS:
            which = "" if stream is not None else f"prompt {n // samples + 1} sample {n % samples + 1} "
            print(f"[{which}stopped at the position limit of {model.config.max_position_embeddings}]", file=sys.stderr)
    made = sum(len(t) for t in result.tokens)
    layout = model.layout
    print(
        f"mtnlg-generate: {made} tokens for {len(prompts)} prompt(s) in {result.seconds:.2f} s "
        f"({made / max(result.seconds, 1e-9):.1f} tokens/s) on {layout.world_size} rank(s) "
        f"(tp {layout.tensor_parallel} x pp {layout.pipeline_parallel} x dp {layout.data_parallel}"
        f"{f', experts over ep {layout.expert_parallel}' if layout.expert_parallel > 1 else ''}) of "
        f"{model.device.type}, {str(model.dtype)[6:]}",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    prompts: list[str] = []

    def check(args) -> dict[str, str] | None:
        check_sampling(args)
        prompts.extend(read_prompts(args.prompt))
        return {PROMPTS_ENV: json.dumps(prompts)} if args.prompt == "-" else None

    chats: list[Chat] = []

    def prepare(plan) -> None:  # a chat's tokenizer and template, and its prompts rendered, before weights load
        if args.chat:
            chat = chat_for(plan.source, args.checkpoint, args.tokenizer, args.chat_template)
            for prompt in prompts:
                chat.prompt_ids(prompt, args.system)
            chats.append(chat)

    def work(model, plan) -> None:
        generate_and_print(args, prompts, model, plan, chats[0] if chats else None)

    prog, module = "mtnlg-generate", "mtnlg_lightning.inference.generate_cli"
    return run(prog, module, args, argv, check, work, decoding=True, prepare=prepare)


if __name__ == "__main__":
    sys.exit(main())
