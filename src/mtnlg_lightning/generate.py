"""Text generation with a KV cache: `generate(...)` from Python, `mtnlg-generate` on the command line.

    mtnlg-generate --checkpoint runs/demo/checkpoints/last.ckpt --prompt "Return the" --max-new-tokens 64

Works on a project checkpoint or a Hugging Face GPT-2 directory. The prompt is run once (prefill) and its keys and
values are cached per layer, so each new token costs one position instead of re-running the whole prefix.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtnlg_lightning.errors import MTNLGError, one_line
from mtnlg_lightning.model import GPT, build_model

EOS, LENGTH, POSITIONS = "<|endoftext|>", "max-new-tokens", "position limit"


# ------------------------------------------------------------------------------------------- the model
def pick_device(device: str = "auto") -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """bf16 where the GPU supports it, else fp32 (`auto`); or what the user asks."""
    if dtype == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def load_model(source, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(GPT in eval mode, ModelState) from a project checkpoint or a Hugging Face GPT-2 directory."""
    from mtnlg_lightning.interop.gpt2_mapping import load_model_space
    from mtnlg_lightning.interop.hf import read_source

    state = read_source(source)
    model = build_model(state.config)
    load_model_space(model, state.weights)
    return model.to(device=device, dtype=dtype).eval(), state


# ------------------------------------------------------------------------------------------- decoding
class KVCache:
    """Keys and values of every layer, preallocated for `length` positions: [layers][B, heads, length, hd]."""

    def __init__(self, model: GPT, batch: int, length: int):
        param = model.embed.wte.weight
        c = model.config
        shape = (batch, c.num_heads, length, c.head_dim)
        self.k = [torch.empty(shape, dtype=param.dtype, device=param.device) for _ in range(c.num_layers)]
        self.v = [torch.empty(shape, dtype=param.dtype, device=param.device) for _ in range(c.num_layers)]


def forward_cached(model: GPT, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
    """Logits of the last position for `tokens` [B, S] placed at positions start.. (S > 1 only at start 0, the
    prefill), keys/values appended to `cache`. The same modules and arithmetic as `GPT.forward`."""
    B, S = tokens.shape
    if S > 1 and start:
        raise ValueError("several tokens at once only for the prefill (start 0)")
    positions = torch.arange(start, start + S, device=tokens.device)
    h = model.embed.wte(tokens) + model.embed.wpe(positions)
    for i, block in enumerate(model.blocks.values()):
        attn = block.attn
        qkv = attn.qkv(block.ln1(h)).view(B, S, -1, 3, attn.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        cache.k[i][:, :, start : start + S] = k
        cache.v[i][:, :, start : start + S] = v
        keys, values = cache.k[i][:, :, : start + S], cache.v[i][:, :, : start + S]
        y = F.scaled_dot_product_attention(q, keys, values, is_causal=S > 1)  # one query sees every cached key
        h = h + attn.proj(y.transpose(1, 2).reshape(B, S, -1))
        h = h + block.mlp(block.ln2(h))
    return model.lm_head(model.norm(h[:, -1]))


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator=None):
    """Next token per row of `logits` [B, V]: argmax at temperature 0, else softmax(logits / T) cut to the top-k
    tokens and to the smallest set holding probability top-p."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs > top_p  # the most likely token always stays
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(outside, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per sample (the end-of-text token excluded)
    stop: list[str]  # per sample: "<|endoftext|>", "max-new-tokens" or "position limit"
    seconds: float


@torch.inference_mode()
def generate(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_samples: int = 1,
    eos_id: int | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    on_token: Callable[[int, list[int]], None] | None = None,
) -> Generation:
    """Continue `prompt` (token ids) `num_samples` times in one batch. Stops at `eos_id`, after `max_new_tokens`
    or at the model's position limit. `on_token(sample, tokens so far)` is called as tokens are made.
    `use_cache=False` re-runs the whole prefix for every token (the baseline the cache is measured against)."""
    limit = model.config.max_position_embeddings
    vocab = model.config.vocab_size  # padded rows of the embedding are never sampled
    if not prompt:
        raise MTNLGError("the prompt is empty (it needs at least one token)")
    if len(prompt) >= limit:
        raise MTNLGError(f"the prompt has {len(prompt)} tokens; the model's position limit is {limit}")
    device = model.embed.wte.weight.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    steps = min(max_new_tokens, limit - len(prompt))
    tokens = torch.tensor([prompt] * num_samples, device=device)
    cache = KVCache(model, num_samples, len(prompt) + steps) if use_cache else None
    out: list[list[int]] = [[] for _ in range(num_samples)]
    stop = [""] * num_samples
    started = time.perf_counter()
    logits = forward_cached(model, tokens, cache, 0) if use_cache else model(tokens)[:, -1]
    for step in range(steps):
        nxt = sample(logits[:, :vocab], temperature, top_k, top_p, generator)
        for i, t in enumerate(nxt.tolist()):
            if stop[i]:
                continue
            if t == eos_id:
                stop[i] = EOS
                continue
            out[i].append(t)
            if on_token is not None:
                on_token(i, out[i])
        if all(stop) or step == steps - 1:
            break
        if use_cache:
            logits = forward_cached(model, nxt[:, None], cache, len(prompt) + step)
        else:
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            logits = model(tokens)[:, -1]
    ended = LENGTH if steps == max_new_tokens else POSITIONS
    return Generation(out, [s or ended for s in stop], time.perf_counter() - started)


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
    return p


def resolve_tokenizer(state, override: str | None):
    from mtnlg_lightning.data.tokenizer import Tokenizer

    path = override or state.tokenizer
    if path is None:
        raise MTNLGError("the checkpoint names no tokenizer: pass --tokenizer PATH (tokenizer.json or directory)")
    return Tokenizer(path)


def run(args) -> None:
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise MTNLGError("--max-new-tokens and --num-samples must be at least 1")
    device = pick_device(args.device)
    model, state = load_model(args.checkpoint, device, pick_dtype(args.dtype, device))
    tokenizer = resolve_tokenizer(state, args.tokenizer)
    prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()] if args.prompt == "-" else [args.prompt]
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
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except MTNLGError as error:
        print(f"mtnlg-generate: error: {one_line(error)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
