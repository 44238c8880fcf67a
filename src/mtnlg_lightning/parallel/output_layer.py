"""The output layer inside the loss: logits made only where a label counts, a chunk of tokens at a time.

A [tokens x vocabulary] fp32 logits tensor, its softmax and its gradient are what a large vocabulary costs in
training: 2.5 GB per copy at Qwen 3's 151,936 tokens and 4,096 tokens of a micro-batch. So in a training step the
model stops at its final norm (`heads_in_loss`, entered by the step's runners) and the layout's token loss
(`OutputLoss`, made by `parallelize_gpt`) applies the LM head itself, as Liger's fused linear cross-entropy, Apple's
Cut Cross-Entropy and torchtune's chunked loss do:
- only at the positions whose label counts: a prompt, padding or a document boundary costs no head FLOPs (torchtune
  drops them alike; GRPO and SFT score completions only);
- where a micro-batch's fp32 logits would pass `CHUNK_BYTES` (or `chunk_tokens` says so), a chunk of tokens at a
  time. The training loss (a token mean) writes each chunk's gradients in its forward (`_FusedLinearCrossEntropy`,
  as Liger does): the head's three matmuls as ever, one chunk's logits alive at once. The per-token scores of DPO
  and GRPO, whose gradients depend on what follows, recompute each chunk in the backward (`torch.utils.checkpoint`:
  one more pass of the head's forward matmul);
- under TP, the head's input is made whole once (`VocabParallelLMHead.whole_input`: copied, or gathered under SP)
  and each chunk's loss is the vocabulary-parallel cross-entropy, without gathering the vocabulary.
Where every label counts and one piece fits, the loss is computed as without this module, bit for bit (the
pretraining runs); otherwise the loss and gradients equal the one-piece path to fp32 rounding (1e-6).

The same object scores tokens for the objectives that need per-token log-probabilities (`per_token`: DPO's
sequence log-probabilities, GRPO's at its sampling temperature) and GRPO's entropy metric, in the same chunks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ReduceOp, all_reduce
from torch.utils.checkpoint import checkpoint

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.loss import IGNORE_INDEX, cross_entropy, token_mean
from mtnlg_lightning.model import GPT
from mtnlg_lightning.parallel.tensor_parallel import (
    VocabParallelLMHead,
    minus_label,
    softmax_and_nll,
    vocab_parallel_cross_entropy,
    vocab_parallel_nll,
)

# Past this many bytes of a micro-batch's fp32 logits (this rank's vocabulary slice), the loss runs in chunks of
# about this size: 256 MiB is 1,365 tokens of a 49,152-token vocabulary, 441 of a 151,936-token one.
CHUNK_BYTES = 256 * 2**20


def check_chunk_tokens(chunk_tokens: int | None) -> None:
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or chunk_tokens < 0):
        raise MTNLGError(
            f"model.loss_chunk_tokens must be null (automatic), 0 (one piece) or a positive token count, "
            f"got {chunk_tokens!r}"
        )


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """The summed -log p(label) over counted rows of h [n, H] @ weight^T, chunk by chunk, with the gradients
    written in the forward (Liger's fused linear cross-entropy): a chunk's logits become its softmax, then the
    gradient of its logits, and are gone before the next chunk; the backward only scales the kept gradients of h and
    the weight by the incoming one. No recomputation: the head's three matmuls, as without chunks."""

    @staticmethod
    def forward(ctx, h, weight, labels, size: int, group, with_grads: bool):
        counted = labels.ne(IGNORE_INDEX)
        grad_h = torch.zeros_like(h) if with_grads and ctx.needs_input_grad[0] else None
        wants_w = with_grads and ctx.needs_input_grad[1]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, len(h), size):
            rows = slice(start, start + size)
            logits = F.linear(h[rows], weight)  # in autocast's dtype where it is on, as the head's own call
            nll, grad, inside, column = softmax_and_nll(logits.float(), labels[rows], group)
            keep = counted[rows]
            total += nll.masked_fill(~keep, 0.0).sum()
            if grad_h is None and grad_w is None:
                continue
            grad = minus_label(grad, inside, column).mul_(keep.unsqueeze(-1)).to(logits.dtype)  # ignored: none
            if grad_h is not None:
                grad_h[rows] = grad.matmul(weight.to(grad.dtype)).to(h.dtype)
            if grad_w is None:
                continue
            if grad.dtype == torch.float32:  # accumulated in place: no [V, H] temporary per chunk
                grad_w.addmm_(grad.t(), h[rows].float())
            else:  # autocast's dtype, as the plain path's backward matmul (then summed in fp32)
                grad_w.add_(grad.t().matmul(h[rows].to(grad.dtype)))
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors  # this call's own buffers, used once: scaled in place
        grad_h = grad_h.mul_(grad_total) if grad_h is not None else None
        grad_w = grad_w.mul_(grad_total).to(ctx.weight_dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None


@contextmanager
def heads_in_loss(model: nn.Module):
    """While a training step's runner runs: the models (or stages) in `model` that hold the LM head return their
    final hidden states, for the layout's `OutputLoss` to apply the head. Outside, `model(tokens)` gives logits."""
    models = [m for m in model.modules() if isinstance(m, GPT) and m.lm_head is not None]
    for m in models:
        m.head_in_loss = True
    try:
        yield
    finally:
        for m in models:
            m.head_in_loss = False


class OutputLoss:
    """The layout's token loss on the final hidden states [B, S, H] of `owner` (this rank's last stage model, whose
    `lm_head` makes the logits: read at each call, as the pipeline's tie refreshes a copy of it). `owner` None: the
    output is logits [B, S, V] already (a model that kept its head: tools and tests scoring a plain model).

    group: the TP group when the head holds a vocabulary slice, else None. vocab_local: the rows of this rank's
    head (the padded vocabulary over TP). chunk_tokens: None: chunks only past `CHUNK_BYTES`; 0: one piece; n:
    chunks of n tokens."""

    def __init__(self, owner: nn.Module | None = None, vocab_local: int = 0, group=None, chunk_tokens: int | None = 0):
        check_chunk_tokens(chunk_tokens)
        self.owner, self.vocab_local, self.group, self.chunk_tokens = owner, vocab_local, group, chunk_tokens

    # ------------------------------------------------------------------------------------------ the pieces
    def chunk_size(self, rows: int) -> int:
        """How many of `rows` scored positions go through the head at once."""
        if self.chunk_tokens is None:
            row_bytes = 4 * self.vocab_local
            return rows if rows * row_bytes <= CHUNK_BYTES else max(1, CHUNK_BYTES // row_bytes)
        return self.chunk_tokens or rows

    def _whole_input(self, hidden: torch.Tensor) -> torch.Tensor:
        head = getattr(self.owner, "lm_head", None)
        return head.whole_input(hidden) if isinstance(head, VocabParallelLMHead) else hidden

    def _nll(self, h: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
        logits = (h if weight is None else F.linear(h, weight)).float()
        if temperature != 1.0:
            logits = logits / temperature
        if self.group is None:
            return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
        return vocab_parallel_nll(logits, labels, self.group)

    def _scored(self, hidden: torch.Tensor, labels: torch.Tensor):
        """(the head's input at the scored positions [n, H], their labels [n], their flat indices or None when
        every position is scored). With no label counted, position 0 stands in (scored, then zeroed), so the graph
        and every rank's collectives stay as in any other micro-batch."""
        h = self._whole_input(hidden).flatten(0, -2)
        flat = labels.flatten()
        counted = flat.ne(IGNORE_INDEX)
        rows = counted.nonzero().squeeze(1)
        if len(rows) == len(flat):
            return h, flat, None
        if len(rows) == 0:
            rows = rows.new_zeros(1)
        return h.index_select(0, rows), flat.index_select(0, rows), rows

    def _in_chunks(self, fn, h: torch.Tensor, labels: torch.Tensor, *args) -> torch.Tensor:
        """fn(h piece, labels piece, the head's weight, *args) over the pieces, in one call of the head module
        (`model.OutputHead`): hooks on module calls (ZeRO-3's gathering of the weight) fire once on every rank,
        whatever number of chunks its counted labels make."""
        size = self.chunk_size(len(h))

        def over_pieces(weight: torch.Tensor) -> torch.Tensor:
            if size >= len(h):
                return fn(h, labels, weight, *args)
            recompute = torch.is_grad_enabled()
            parts = []
            for start in range(0, len(h), size):
                piece = (h[start : start + size], labels[start : start + size], weight, *args)
                parts.append(checkpoint(fn, *piece, use_reentrant=False) if recompute else fn(*piece))
            return torch.cat(parts)

        return over_pieces(None) if self.owner is None else self.owner.lm_head(h, within=over_pieces)

    def _spread(self, values: torch.Tensor, rows, labels: torch.Tensor) -> torch.Tensor:
        """Per-position values [B, S]: `values` at the scored positions, 0 elsewhere."""
        if rows is None:
            return values.view(labels.shape)
        kept = values * labels.flatten().index_select(0, rows).ne(IGNORE_INDEX)  # the stand-in of no label: 0
        return values.new_zeros(labels.numel()).index_add(0, rows, kept).view(labels.shape)

    # ------------------------------------------------------------------------------------------ the losses
    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The token mean of -log p(label) over the counted labels (`loss.token_mean`)."""
        if self.chunk_size(labels.numel()) >= labels.numel() and bool(labels.ne(IGNORE_INDEX).all()):
            # every position scored, in one piece: as without this module
            logits = hidden if self.owner is None else self.owner.lm_head(hidden)
            if self.group is None:
                return cross_entropy(logits, labels)
            return vocab_parallel_cross_entropy(logits, labels, self.group)
        if self.owner is None:
            return token_mean(self.per_token(hidden, labels), labels)
        h, scored_labels, _ = self._scored(hidden, labels)
        size, with_grads = self.chunk_size(len(h)), torch.is_grad_enabled()

        def fused(weight: torch.Tensor) -> torch.Tensor:
            return _FusedLinearCrossEntropy.apply(h, weight, scored_labels, size, self.group, with_grads)

        return self.owner.lm_head(h, within=fused) / labels.ne(IGNORE_INDEX).sum().clamp(min=1)

    def per_token(self, hidden: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """-log p(label) [B, S] in fp32 under softmax(logits / temperature); 0 where the label is ignored."""
        h, scored_labels, rows = self._scored(hidden, labels)
        return self._spread(self._in_chunks(self._nll, h, scored_labels, temperature), rows, labels)

    @torch.no_grad()
    def entropy(self, hidden: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """The entropy [B, S] of softmax(logits / temperature) over the whole vocabulary where the label counts, 0
        elsewhere (a metric: no gradient)."""
        h, scored_labels, rows = self._scored(hidden, labels)
        return self._spread(self._in_chunks(self._entropy, h, scored_labels, temperature), rows, labels)

    def _entropy(self, h: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, temperature: float):
        logits = (h if weight is None else F.linear(h, weight)).float() / temperature
        peak = logits.amax(-1, keepdim=True)
        if self.group is not None:
            all_reduce(peak, op=ReduceOp.MAX, group=self.group)
        weights = torch.exp(logits - peak)
        parts = torch.stack([weights.sum(-1), (weights * (logits - peak)).sum(-1)])
        if self.group is not None:
            all_reduce(parts, group=self.group)
        return torch.log(parts[0]) - parts[1] / parts[0]
