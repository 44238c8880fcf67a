"""Megatron's tensor-parallel pieces against their single-device definitions, ranks as threads of this process."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from threaded_group import run_ranks
from torch import nn

from mtnlg_lightning.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_parallel_region,
    gather_tensor_parallel,
    reduce_from_tensor_parallel_region,
    vocab_parallel_cross_entropy,
)

TP = 2


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_f_is_identity_forward_and_all_reduce_backward():
    def rank_fn(rank):
        x = torch.ones(3, dtype=torch.float64, requires_grad=True)
        y = copy_to_tensor_parallel_region(x, dist.group.WORLD)
        (y * (rank + 1)).sum().backward()
        return y.detach(), x.grad

    for y, grad in run_ranks(TP, rank_fn):
        assert torch.equal(y, torch.ones(3, dtype=torch.float64))
        assert torch.equal(grad, torch.full((3,), 3.0, dtype=torch.float64))  # 1 + 2 summed over the ranks


def test_g_is_all_reduce_forward_and_identity_backward():
    def rank_fn(rank):
        x = torch.full((3,), float(rank + 1), dtype=torch.float64, requires_grad=True)
        y = reduce_from_tensor_parallel_region(x, dist.group.WORLD)
        (y * 5).sum().backward()
        return y.detach(), x.grad

    for y, grad in run_ranks(TP, rank_fn):
        assert torch.equal(y, torch.full((3,), 3.0, dtype=torch.float64))
        assert torch.equal(grad, torch.full((3,), 5.0, dtype=torch.float64))


def test_column_then_row_parallel_linear_equals_the_two_linears():
    fc1, fc2 = nn.Linear(8, 16).double(), nn.Linear(16, 8).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    x_ref = x.clone().requires_grad_(True)
    y_ref = fc2(F.gelu(fc1(x_ref)))
    y_ref.pow(2).sum().backward()

    def rank_fn(rank):
        group = dist.group.WORLD
        col = ColumnParallelLinear.from_linear(fc1, group, rank, TP)
        row = RowParallelLinear.from_linear(fc2, group, rank, TP)
        x_local = x.clone().requires_grad_(True)
        y = row(F.gelu(col(x_local)))
        y.pow(2).sum().backward()
        gathered_fc1 = gather_tensor_parallel(col.weight.grad, 0, group)
        gathered_fc2 = gather_tensor_parallel(row.weight.grad, 1, group)
        return y.detach(), x_local.grad, gathered_fc1, gathered_fc2, row.bias.grad

    for y, x_grad, fc1_grad, fc2_grad, bias_grad in run_ranks(TP, rank_fn):
        torch.testing.assert_close(y, y_ref.detach())
        torch.testing.assert_close(x_grad, x_ref.grad)
        torch.testing.assert_close(fc1_grad, fc1.weight.grad)
        torch.testing.assert_close(fc2_grad, fc2.weight.grad)
        torch.testing.assert_close(bias_grad, fc2.bias.grad)


def test_vocab_parallel_embedding_equals_the_embedding():
    embedding = nn.Embedding(12, 4).double()
    tokens = torch.tensor([[0, 5, 6, 11], [3, 9, 2, 7]])
    expected = embedding(tokens).detach()
    for out in run_ranks(
        TP, lambda rank: VocabParallelEmbedding.from_embedding(embedding, dist.group.WORLD, rank, TP)(tokens)
    ):
        torch.testing.assert_close(out.detach(), expected)


def test_vocab_parallel_cross_entropy_loss_and_gradient_equal_cross_entropy():
    logits = torch.randn(3, 5, 16, dtype=torch.float64) * 3
    labels = torch.randint(0, 16, (3, 5))
    labels[0, 0], labels[1, 1] = 0, 15  # targets in both vocabulary halves, at the edges
    reference = logits.clone().requires_grad_(True)
    expected = F.cross_entropy(reference.flatten(0, 1), labels.flatten())
    expected.backward()

    def rank_fn(rank):
        shard = logits[..., rank * 8 : (rank + 1) * 8].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(shard, labels, dist.group.WORLD)
        loss.backward()
        return loss.detach(), shard.grad

    (loss0, grad0), (loss1, grad1) = run_ranks(TP, rank_fn)
    # The loss runs in fp32 (as under bf16 training), so compare at fp32 tolerance.
    torch.testing.assert_close(loss0, expected.detach().float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(loss0, loss1)
    torch.testing.assert_close(torch.cat([grad0, grad1], dim=-1), reference.grad, rtol=1e-5, atol=1e-6)
