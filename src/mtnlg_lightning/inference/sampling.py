"""Choosing the next token, and what a generation returns (`inference.decode`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

EOS, LENGTH, POSITIONS = "<|endoftext|>", "max-new-tokens", "position limit"


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
    tokens: list[list[int]]  # new tokens per sample (an end token excluded, a stop text's tokens included)
    stop: list[str]  # per sample: "<|endoftext|>" (an end token or stop text), "max-new-tokens" or "position limit"
    seconds: float
    # per sample, each new token's log-probability under softmax(logits / temperature) as the sampler saw it (argmax's
    # logits unscaled at temperature 0); on the ranks of the last pipeline stage, None elsewhere
    logprobs: list[list[float]] | None = None
