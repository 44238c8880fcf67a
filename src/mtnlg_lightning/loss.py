"""The language-modelling objective: labels that may be ignored, and the token mean over the global batch.

A batch carries `labels` beside its `input_ids` (the shift is done once, by the data); a label of IGNORE_INDEX
(-100, as in torch and Hugging Face) is not trained on (a prompt, padding, a document boundary). Every loss path (one
process, the vocabulary-parallel cross-entropy, the last pipeline stage, the context-parallel chunks) returns the
mean over the counted labels of what it was given, and `StepLoss` weights each micro-batch by its share of the
counted labels of the whole global batch, so that the gradients summed over micro-batches and averaged over the
data-parallel replicas are those of one token mean over the global batch, in any layout and under accumulation.

Where every label counts (pretraining), each weight is exactly 1.0 and the losses are bit-for-bit those of a plain
mean per micro-batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def counted_labels(labels: torch.Tensor) -> torch.Tensor:
    """How many labels are trained on (a 0-dim int64 tensor on the labels' device)."""
    return labels.ne(IGNORE_INDEX).sum()


def token_mean(per_token: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean of per-token losses over the counted labels; 0 (with a graph) where none counts. Ignored positions
    may hold anything (the vocabulary-parallel loss gives them the log-sum-exp). With every label counted, the
    result is bit-for-bit `per_token.mean()`: the correction factor is then exactly 1.0."""
    counted = labels.ne(IGNORE_INDEX)
    count = counted.sum()
    # torch.div of two integers, not `int / tensor` (which multiplies by a rounded reciprocal: not exactly 1.0).
    correction = torch.div(count.new_tensor(counted.numel()), count.clamp(min=1))
    return per_token.masked_fill(~counted, 0.0).mean() * correction


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy of logits [B, S, V] against labels [B, S] in fp32, IGNORE_INDEX skipped; 0 when no
    label counts (torch's mean would be 0/0; its gradient is zero there, so `where` keeps it finite)."""
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    return torch.where(counted_labels(labels) > 0, loss, torch.zeros_like(loss))


class StepLoss:
    """The loss of one micro-batch of an optimizer step: `loss_fn`'s token mean times the micro-batch's share of the
    step's counted labels, n_i x micro_batches x world_size / counted_in_world (`counted_in_world`: the counted
    labels summed over every rank, so ranks that hold the same data (tensor-, pipeline-, context-parallel) count
    them as often as they average them). The caller divides by `micro_batches`, as for a plain mean."""

    def __init__(self, loss_fn, micro_batches: int, world_size: int, counted_in_world: int):
        self.loss_fn = loss_fn
        self.scale = float(micro_batches * world_size)
        self.counted_in_world = float(max(counted_in_world, 1))

    def share(self, labels: torch.Tensor) -> torch.Tensor:
        # In float64: with equal counts, n x M x W equals the total exactly and the share is exactly 1.0.
        return (counted_labels(labels).double() * self.scale / self.counted_in_world).float()

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, labels) * self.share(labels)
