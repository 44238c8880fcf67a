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
from torch import nn

from mtnlg_lightning.errors import MTNLGError, one_line
from mtnlg_lightning.model import GPT, build_model

EOS, LENGTH, POSITIONS = "<|endoftext|>", "max-new-tokens", "position limit"


# ------------------------------------------------------------------------------------------- the model
def pick_device(device: str = "auto") -> torch.device:
    """`auto` (the GPU when there is one), or the device asked for if this machine has it (else one line)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise MTNLGError(f"unknown --device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if chosen.type == "cpu":
        return chosen
    backend = getattr(torch, chosen.type, None)
    if backend is None or not getattr(backend, "is_available", lambda: False)():
        raise MTNLGError(f"--device {device}: no {chosen.type} device is available on this machine (use cpu or auto)")
    count = getattr(backend, "device_count", lambda: 1)()
    if chosen.index is not None and chosen.index >= count:
        raise MTNLGError(f"--device {device}: this machine has {count} {chosen.type} device(s)")
    return chosen


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """bf16 where the GPU supports it, else fp32 (`auto`); or what the user asks."""
    if dtype == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def load_model(
    source, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, for_generation: bool = False
):
    """(GPT in eval mode, ModelState) from a project checkpoint or a Hugging Face GPT-2 directory.
    `for_generation`: also store the weights in the layout decoding is fastest with (`use_generation_layout`)."""
    from mtnlg_lightning.interop.gpt2_mapping import load_model_space
    from mtnlg_lightning.interop.hf import read_source

    state = read_source(source)
    model = build_model(state.config)
    load_model_space(model, state.weights)
    model = model.to(device=device, dtype=dtype).eval()
    return (use_generation_layout(model) if for_generation else model), state


def _matrices(model: GPT) -> list[nn.Parameter]:
    """The Linear weights of the blocks and the tied embedding / LM head matrix, each once."""
    found = {id(model.embed.wte.weight): model.embed.wte.weight}
    for block in model.blocks.values():
        for linear in (block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2):
            found[id(linear.weight)] = linear.weight
    return list(found.values())


@torch.no_grad()
def use_generation_layout(model: GPT) -> GPT:
    """On a CPU, store every weight matrix [out, in] transposed in memory (strides (1, out)), in place: the same
    parameters, shapes and values, and `model(x)` computes the same function. Decoding multiplies one row per
    sample by each matrix, and there `x @ W` with W's rows laid out [in, out] is the faster matrix-vector product
    (measured on this project's CPU: ~10% on the blocks' Linear layers, ~25% on the LM head, which is also why
    GPT-2's Conv1D layout beats nn.Linear's there). On other devices the model is left as it is."""
    if model.embed.wte.weight.device.type != "cpu":
        return model
    for weight in _matrices(model):
        if weight.is_contiguous():
            weight.data = weight.data.t().contiguous().t()
    return model


# ------------------------------------------------------------------------------------------- decoding
class KVCache:
    """Keys and values of every layer, preallocated for `length` positions: [layers][B, heads, length, hd];
    each step writes its position in place."""

    def __init__(self, model: GPT, batch: int, length: int):
        param = model.embed.wte.weight
        c = model.config
        shape = (batch, c.num_heads, length, c.head_dim)
        self.k = [torch.empty(shape, dtype=param.dtype, device=param.device) for _ in range(c.num_layers)]
        self.v = [torch.empty(shape, dtype=param.dtype, device=param.device) for _ in range(c.num_layers)]


class Decoder:
    """`GPT.forward`'s arithmetic for generation with a KV cache, as plain tensor ops on the model's parameters
    (gathered once per `generate` call, so a step does no module dispatch): rows [B * S, H] throughout, biases
    fused into `addmm` with the weights taken as [in, out] (`W.t()`, contiguous after `use_generation_layout`),
    no attention mask after the prefill (one query attends to every cached key) and LM-head logits only for the
    last position and the tokenizer's vocabulary (not the padding rows)."""

    def __init__(self, model: GPT):
        plain = (nn.Linear, nn.LayerNorm, nn.Embedding)
        for name, module in model.named_modules():
            if isinstance(module, plain) and type(module) not in plain:  # e.g. a tensor-parallel shard
                raise MTNLGError(f"generation needs a single-process GPT; {name} is a {type(module).__name__}")
        c = model.config
        self.heads, self.head_dim, self.hidden = c.num_heads, c.head_dim, c.hidden_size
        self.wte, self.wpe = model.embed.wte.weight, model.embed.wpe.weight
        self.head = model.lm_head.weight[: c.vocab_size].t()  # [H, vocab]
        self.norm = (model.norm.weight, model.norm.bias, model.norm.eps)
        self.layers = [
            (
                (b.ln1.weight, b.ln1.bias, b.ln1.eps),
                (b.attn.qkv.bias, b.attn.qkv.weight.t()),
                (b.attn.proj.bias, b.attn.proj.weight.t()),
                (b.ln2.weight, b.ln2.bias, b.ln2.eps),
                (b.mlp.fc1.bias, b.mlp.fc1.weight.t()),
                (b.mlp.fc2.bias, b.mlp.fc2.weight.t()),
            )
            for b in model.blocks.values()
        ]

    def __call__(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """Logits [B, vocab] of the last position for `tokens` [B, S] placed at positions start.. (S > 1 only at
        start 0, the prefill); their keys and values are written into `cache`."""
        B, S = tokens.shape
        if S > 1 and start:
            raise ValueError("several tokens at once only for the prefill (start 0)")
        end, H, shape = start + S, (self.hidden,), (B, S, self.heads, 3, self.head_dim)
        h = (F.embedding(tokens, self.wte) + self.wpe[start:end]).view(B * S, self.hidden)
        for i, (ln1, (b_qkv, w_qkv), (b_proj, w_proj), ln2, (b_fc1, w_fc1), (b_fc2, w_fc2)) in enumerate(self.layers):
            qkv = torch.addmm(b_qkv, F.layer_norm(h, H, *ln1), w_qkv)
            q, k, v = qkv.view(shape).transpose(1, 2).unbind(dim=3)  # each [B, heads, S, head_dim]
            keys, values = cache.k[i], cache.v[i]
            keys[:, :, start:end] = k
            values[:, :, start:end] = v
            y = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], is_causal=S > 1)
            h = h + torch.addmm(b_proj, y.transpose(1, 2).reshape(B * S, self.hidden), w_proj)
            u = F.gelu(torch.addmm(b_fc1, F.layer_norm(h, H, *ln2), w_fc1), approximate="tanh")
            h = h + torch.addmm(b_fc2, u, w_fc2)
        last = h.view(B, S, self.hidden)[:, -1]
        return torch.mm(F.layer_norm(last, H, *self.norm), self.head)


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
    decoder, cache = (Decoder(model), KVCache(model, num_samples, len(prompt) + steps)) if use_cache else (None, None)
    out: list[list[int]] = [[] for _ in range(num_samples)]
    stop = [""] * num_samples
    started = time.perf_counter()
    logits = decoder(tokens, cache, 0) if use_cache else model(tokens)[:, -1, :vocab]
    for step in range(steps):
        nxt = sample(logits, temperature, top_k, top_p, generator)
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
            logits = decoder(nxt[:, None], cache, len(prompt) + step)
        else:
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            logits = model(tokens)[:, -1, :vocab]
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


def resolve_tokenizer(state, override: str | None):
    from mtnlg_lightning.data.tokenizer import Tokenizer

    path = override or state.tokenizer
    if path is None:
        raise MTNLGError("the checkpoint names no tokenizer: pass --tokenizer PATH (tokenizer.json or directory)")
    return Tokenizer(path)


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


def read_prompts(prompt: str) -> list[str]:
    """The prompt, or with '-' the non-empty lines of stdin (UTF-8; anything else is one line)."""
    if prompt != "-":
        return [prompt]
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise MTNLGError(f"stdin is not UTF-8 text (byte {error.start} is {data[error.start]:#04x})") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise MTNLGError("--prompt -: stdin holds no prompt (one a line)")
    return prompts


def run(args) -> None:
    check_sampling(args)
    prompts = read_prompts(args.prompt)
    device = pick_device(args.device)
    model, state = load_model(args.checkpoint, device, pick_dtype(args.dtype, device), for_generation=True)
    tokenizer = resolve_tokenizer(state, args.tokenizer)
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
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.strategy or args.devices:
        from mtnlg_lightning.inference.runs import run_generate

        return run_generate(args, argv)
    try:
        run(args)
    except MTNLGError as error:
        print(f"mtnlg-generate: error: {one_line(error)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
