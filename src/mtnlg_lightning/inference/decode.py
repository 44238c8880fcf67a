"""The single-process decode loop: the model's own forward with its KV cache, token by token.

A sharded model decodes in `inference.generation`; the `mtnlg-generate` CLI (`generate.py`) and the harness adapter
both call `generate` here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.inference.sampling import EOS, LENGTH, POSITIONS, Generation, sample
from mtnlg_lightning.model import GPT, KVCache


def check_single_process(model: GPT) -> None:
    """`generate` decodes the whole vocabulary on one process; a sharded model decodes in `inference.generation`."""
    plain = (nn.Linear, nn.LayerNorm, nn.Embedding)
    for name, module in model.named_modules():
        if isinstance(module, plain) and type(module) not in plain:  # e.g. a tensor-parallel shard
            raise MTNLGError(f"generation needs a single-process GPT; {name} is a {type(module).__name__}")


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
    check_single_process(model)
    cache = KVCache(len(prompt) + steps) if use_cache else None  # the model's own forward reads and fills it
    out: list[list[int]] = [[] for _ in range(num_samples)]
    stop = [""] * num_samples
    started = time.perf_counter()
    logits = model(tokens, cache)[:, -1, :vocab]
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
            cache.start = len(prompt) + step
            logits = model(nxt[:, None], cache)[:, -1, :vocab]
        else:
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            logits = model(tokens)[:, -1, :vocab]
    ended = LENGTH if steps == max_new_tokens else POSITIONS
    return Generation(out, [s or ended for s in stop], time.perf_counter() - started)
