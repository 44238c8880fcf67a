"""The output layer inside the loss (`parallel/output_layer.py`): the LM head applied only where a label counts, in
chunks of tokens recomputed in the backward, gives the losses, per-token log-probabilities, entropies and gradients
of the plain path (full logits, then the cross-entropy), in one process and vocabulary-parallel over TP (with and
without sequence parallelism); no tensor of [tokens x vocabulary] is kept for the backward.

The layouts (PP's last stage, CP's chunks, DP) train with chunks in `test_labels.py`'s layout runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from threaded_group import run_ranks
from torch import nn

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.grpo_loss import completion_entropy, completion_logps
from mtnlg_lightning.loss import IGNORE_INDEX, cross_entropy
from mtnlg_lightning.model import OutputHead
from mtnlg_lightning.parallel import output_layer
from mtnlg_lightning.parallel.output_layer import OutputLoss
from mtnlg_lightning.parallel.tensor_parallel import VocabParallelLMHead

H, V = 16, 96  # hidden size, vocabulary


class Owner(nn.Module):
    """What `OutputLoss` reads: a (stage) model with an `lm_head`."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.lm_head = head


def inputs(seed: int = 0, rows: int = 3, length: int = 10, ignored: bool = True):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, length, H, generator=generator).requires_grad_()
    labels = torch.randint(0, V, (rows, length), generator=generator)
    if ignored:  # a prompt, a padded tail and a lone ignored position
        labels[0, :4] = IGNORE_INDEX
        labels[1, 7:] = IGNORE_INDEX
        labels[2, 5] = IGNORE_INDEX
    head = OutputHead(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=generator) * 0.3)
    return hidden, labels, head


def gradients(value: torch.Tensor, hidden: torch.Tensor, head: nn.Module):
    return torch.autograd.grad(value, [hidden, head.weight])


@pytest.mark.parametrize("ignored", [True, False], ids=["ignored_labels", "every_label"])
@pytest.mark.parametrize("chunk", [0, 1, 7, 64, None], ids=["one_piece", "1", "7", "64", "auto"])
def test_the_loss_and_gradients_equal_the_plain_cross_entropy(chunk, ignored):
    hidden, labels, head = inputs(ignored=ignored)
    plain = cross_entropy(head(hidden), labels)
    loss = OutputLoss(Owner(head), V, chunk_tokens=chunk)(hidden, labels)
    torch.testing.assert_close(loss, plain, rtol=1e-6, atol=0)
    for got, expected in zip(gradients(loss, hidden, head), gradients(plain, hidden, head), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_every_label_in_one_piece_is_bit_equal_to_the_plain_path():
    hidden, labels, head = inputs(ignored=False)
    assert OutputLoss(Owner(head), V)(hidden, labels).item() == cross_entropy(head(hidden), labels).item()


@pytest.mark.parametrize("chunk", [0, 4])
def test_per_token_log_probabilities_at_a_temperature_and_the_entropy_equal_the_full_logits(chunk):
    hidden, labels, head = inputs(seed=1)
    scorer = OutputLoss(Owner(head), V, chunk_tokens=chunk)
    logps = -scorer.per_token(hidden, labels, temperature=0.7)
    expected = completion_logps(head(hidden), labels, 0.7)
    torch.testing.assert_close(logps, expected, rtol=1e-6, atol=1e-6)
    assert logps[labels.eq(IGNORE_INDEX)].eq(0).all()
    weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(2))  # a GRPO-like token weighting
    got = gradients((logps * weights).sum(), hidden, head)
    for got_grad, expected_grad in zip(got, gradients((expected * weights).sum(), hidden, head), strict=True):
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-6, atol=1e-6)
    entropy = scorer.entropy(hidden, labels, temperature=0.7)
    torch.testing.assert_close(entropy, completion_entropy(head(hidden), labels, 0.7), rtol=1e-6, atol=1e-6)


def test_a_micro_batch_with_no_counted_label_gives_zero_loss_and_zero_gradients():
    hidden, labels, head = inputs()
    labels[:] = IGNORE_INDEX
    loss = OutputLoss(Owner(head), V, chunk_tokens=4)(hidden, labels)
    grads = gradients(loss, hidden, head)
    assert loss.item() == 0.0
    assert all(g.eq(0).all() for g in grads)


@pytest.mark.parametrize("chunk", [8, None])
def test_no_tensor_of_tokens_by_vocabulary_is_kept_for_the_backward(chunk, monkeypatch):
    """What autograd saves between the forward and the backward: chunked, no [chunk-or-more x V] tensor at all; the
    plain path keeps the whole micro-batch's logits (this test's witness that it can see them)."""
    hidden, labels, head = inputs(rows=4, length=32, ignored=False)
    if chunk is None:  # automatic chunks, their budget scaled down to this test's 128 tokens
        monkeypatch.setattr(output_layer, "CHUNK_BYTES", 8 * 4 * V)

    def largest_saved(compute) -> int:
        sizes = [0]

        def pack(tensor):
            sizes.append(tensor.numel() if tensor.shape[-1:] == (V,) else 0)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            compute().backward()
        return max(sizes)

    plain = largest_saved(lambda: cross_entropy(head(hidden), labels))
    chunked = largest_saved(lambda: OutputLoss(Owner(head), V, chunk_tokens=chunk)(hidden, labels))
    assert plain >= 128 * V
    assert chunked <= 8 * V  # one chunk's logits, recomputed in the backward (the head's weight is [V, H])


def test_automatic_chunks_start_where_the_logits_pass_the_budget():
    loss = OutputLoss(Owner(OutputHead(H, 151_936, bias=False)), 151_936, chunk_tokens=None)
    assert loss.chunk_size(64) == 64  # 39 MB of fp32 logits: one piece
    assert loss.chunk_size(4096) == 441  # 2.5 GB: chunks of 256 MiB
    assert OutputLoss(Owner(OutputHead(H, V)), V, chunk_tokens=100).chunk_size(4096) == 100


@pytest.mark.parametrize("bad", [-1, True])
def test_a_bad_chunk_setting_is_refused_in_one_line(bad):
    with pytest.raises(MTNLGError, match="model.loss_chunk_tokens must be"):
        OutputLoss(Owner(OutputHead(H, V)), V, chunk_tokens=bad)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_vocabulary_parallel_chunks_equal_the_full_vocabulary(sequence_parallel):
    """Two TP ranks, each with half the head's rows (and, under SP, half the sequence): the loss, the hidden
    states' gradient and each rank's slice of the head's gradient equal one process's full-vocabulary ones."""
    hidden, labels, head = inputs(seed=3, length=12)
    plain = cross_entropy(head(hidden), labels)
    expected_hidden, expected_weight = gradients(plain, hidden, head)

    def rank(tp_rank: int):
        rows = slice(tp_rank * V // 2, (tp_rank + 1) * V // 2)
        shard = nn.Parameter(head.weight.detach()[rows].clone())
        columns = slice(tp_rank * 6, (tp_rank + 1) * 6) if sequence_parallel else slice(None)
        mine = hidden.detach()[:, columns].clone().requires_grad_()
        owner = Owner(VocabParallelLMHead(shard, dist.group.WORLD, sequence_parallel))
        loss = OutputLoss(owner, V // 2, dist.group.WORLD, chunk_tokens=5)(mine, labels)
        loss.backward()
        return loss.item(), mine.grad, shard.grad

    losses, hidden_grads, weight_grads = zip(*run_ranks(2, rank), strict=True)
    assert losses[0] == losses[1] == pytest.approx(plain.item(), rel=1e-6)
    torch.testing.assert_close(torch.cat(weight_grads), expected_weight)
    if sequence_parallel:  # each rank holds the gradient of its own slice of the sequence
        torch.testing.assert_close(torch.cat(hidden_grads, dim=1), expected_hidden, rtol=1e-5, atol=1e-7)
    else:
        for hidden_grad in hidden_grads:
            torch.testing.assert_close(hidden_grad, expected_hidden, rtol=1e-5, atol=1e-7)


def test_under_bf16_autocast_the_chunks_agree_with_the_plain_path_to_bf16_rounding():
    """The shipped fine-tuning configs train in bf16-mixed: the head's matmuls in bf16 (as autocast runs the plain
    path's), the softmax and the loss in fp32."""
    hidden, labels, head = inputs(seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = cross_entropy(head(hidden), labels)
        expected = gradients(plain, hidden, head)
        loss = OutputLoss(Owner(head), V, chunk_tokens=7)(hidden, labels)
        got = gradients(loss, hidden, head)
    assert loss.item() == pytest.approx(plain.item(), rel=1e-3)
    for got_grad, expected_grad in zip(got, expected, strict=True):
        assert got_grad.dtype == expected_grad.dtype == torch.float32
        torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=1e-2 * expected_grad.abs().max().item())
