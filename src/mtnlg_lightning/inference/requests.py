"""What is scored: (context, continuation) pairs and rolling windows as token `Request`s.

The rules are lm-evaluation-harness' (its `HFLM` backend), so scores agree with it:
- a (context, continuation) pair is tokenized whole and split at the context's length, trailing spaces of the
  context moved to the continuation (`encode_pair`);
- the model sees `(context + continuation)[:-1]`, left-truncated to its position limit; the continuation's
  log-probability is summed over its tokens, and `greedy` says argmax equals it at every one of them;
- rolling log-likelihood (perplexity) predicts every token of a document, the first from `<|endoftext|>`, in windows
  of at most the model's positions, each scoring up to `stride` new tokens with the rest of the window as context
  (stride = positions is the harness' `loglikelihood_rolling`).
"""

from __future__ import annotations

from dataclasses import dataclass


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids) :]


@dataclass
class Request:
    inputs: list[int]  # what the model reads
    targets: list[int]  # the tokens predicted at the last len(targets) input positions


def pair_request(context: list[int], continuation: list[int], max_len: int) -> Request:
    whole = (context + continuation)[-(max_len + 1) :]
    return Request(whole[:-1], continuation)


def rolling_requests(tokens: list[int], prefix: int | None, max_len: int, stride: int | None = None) -> list[Request]:
    """Windows predicting every token of `tokens` (the first from `prefix`; with prefix None, from the second on)."""
    seq = ([prefix] if prefix is not None else []) + list(tokens)
    x, y = seq[:-1], seq[1:]
    stride = min(stride or max_len, max_len)
    out = []
    for start in range(0, len(y), stride):
        end = min(start + stride, len(y))
        out.append(Request(x[max(0, end - max_len) : end], y[start:end]))
    return out
