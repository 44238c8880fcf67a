"""Megatron sequence parallelism (Korthikanti et al. 2022) on top of tensor parallelism, on plain tensors.

With TP alone, everything outside the attention and MLP cores (LayerNorms, residual adds, dropouts, the inputs of
the column-parallel layers) is computed and stored whole on every TP rank. With sequence parallelism those regions
hold only this rank's slice of the sequence ([B, S/TP, H]: the model's layout is batch-first, so the sequence is
dim 1), and each TP all-reduce becomes its two halves:

    shard --all-gather--> column-parallel linear ... row-parallel linear --reduce-scatter--> shard

Forward: all-gather before a column-parallel layer, reduce-scatter after a row-parallel one. Backward: the
conjugates (reduce-scatter of the input gradient, all-gather of the output gradient), plus one more all-gather of
the saved input shard: the column-parallel layer keeps only its shard for the weight gradient and gathers it again
in the backward pass, as Megatron does, so no full-sequence activation outlives the layer.

The embedding (learned positions, as Megatron's `LanguageModelEmbedding`): the vocab-parallel word embedding is
all-reduced, the positions added, and the sum scattered (each rank keeps its slice, no communication; backward:
all-gather). The LM head gathers the sequence before its column-parallel matmul, so the vocab-parallel loss sees
every token. A pipeline stage boundary therefore carries the [B, S/TP, H] shard.

Parameters used on a sequence shard (LayerNorm weights and biases, the row-parallel biases added after the
reduce-scatter) receive only their shard's share of the gradient on each rank: `mark_sequence_parallel` registers
a gradient hook that all-reduces it over the TP group as it is produced, before any optimizer, ZeRO bucket or
clipping sees it (so it works under ZeRO 1/2/3, pipelining and activation checkpointing alike).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtnlg_lightning.errors import MTNLGError

SEQUENCE_DIM = 1  # [B, S, H]


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    # torch >= 2.12 names it all_gather_single (deprecating all_gather_into_tensor); looked up at call time so
    # wrappers installed later (benchmarks/comm_counter.py) see the call.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


# ---------------------------------------------------------------------------------------------- collectives
def _all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/TP, ...] -> [B, S, ...]: the shards of the TP ranks, in rank order."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    shard = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = torch.empty((size * shard.shape[0], *shard.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, shard, group=group)
    return out.movedim(0, SEQUENCE_DIM)


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S, ...] partial sums -> [B, S/TP, ...]: this rank's slice of the sum over the TP ranks."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    full = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = torch.empty((full.shape[0] // size, *full.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, full, group=group)
    return out.movedim(0, SEQUENCE_DIM)


def _sequence_slice(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous slice of the sequence (no communication)."""
    return x.chunk(dist.get_world_size(group), dim=SEQUENCE_DIM)[dist.get_rank(group)].contiguous()


class _IntoSequenceRegion(torch.autograd.Function):
    """Into the sequence-sharded region: whatever the forward did to reach this rank's shard, the gradient of the
    shard is all-gathered backward. Subclasses define the forward and set ``ctx.group``."""

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.group), None


class _ScatterToSequenceRegion(_IntoSequenceRegion):
    """Keep this rank's slice forward (replicated -> sequence-sharded)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_slice(x, group)


class _ReduceScatterToSequenceRegion(_IntoSequenceRegion):
    """Reduce-scatter forward (partial sums -> summed shard): after a row-parallel layer."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)


class _GatherFromSequenceRegion(torch.autograd.Function):
    """Out of the sequence-sharded region: all-gather forward (shard -> whole sequence on every TP rank);
    backward, the whole-sequence gradients the ranks computed from their parts of what follows (a vocabulary slice
    of the LM head) are summed and each rank keeps its slice (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.group), None


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ScatterToSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromSequenceRegion.apply(x, group)


# ---------------------------------------------------------------------------------------------- the gathered matmul
def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run a matmul in (bf16 under bf16 autocast), else the input's."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class _AllGatherLinear(torch.autograd.Function):
    """y = all_gather_sequence(x_shard) @ W^T + b, saving only x_shard (gathered again in the backward pass).

    Casts like autocast (matmuls in the autocast dtype, the gather in that dtype too: half the bytes under bf16),
    and returns gradients in the dtypes of x and the parameters."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        dtype = _compute_dtype(x_shard)
        with torch.autocast(x_shard.device.type, enabled=False):
            x_c, w_c = x_shard.to(dtype), weight.to(dtype)
            out = F.linear(_all_gather_sequence(x_c, group), w_c, bias.to(dtype) if bias is not None else None)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.x_dtype, ctx.w_dtype = x_shard.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(x_c, w_c)
        return out

    @staticmethod
    def backward(ctx, grad):
        x_c, w_c = ctx.saved_tensors
        grad = grad.to(w_c.dtype)
        x_full = _all_gather_sequence(x_c, ctx.group)
        grad_x = _reduce_scatter_sequence(grad.matmul(w_c), ctx.group).to(ctx.x_dtype)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_w = grad_2d.t().matmul(x_full.reshape(-1, x_full.shape[-1])).to(ctx.w_dtype)
        grad_b = grad_2d.sum(0).to(ctx.b_dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def all_gather_linear(x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group) -> torch.Tensor:
    return _AllGatherLinear.apply(x_shard, weight, bias, group)


# ---------------------------------------------------------------------------------------------- modules and grads
def scatter_output_to_sequence(module: nn.Module, group) -> None:
    """`module`'s output (the embedding's, whole on every TP rank) is cut to this rank's sequence slice.

    A forward hook rather than a wrapper module, so parameter names stay those of the single-process model; it
    follows the module's `sequence_parallel` flag (`whole_sequences` lowers it while decoding)."""
    module.sequence_parallel = True
    module.register_forward_hook(
        lambda module, _args, out: scatter_to_sequence_parallel_region(out, group) if module.sequence_parallel else out
    )


@contextmanager
def whole_sequences(modules):
    """Run sequence-parallel `modules` (a model or its pipeline stages) on whole sequences for a while: every layer
    that cuts or gathers the sequence over TP (its `sequence_parallel` flag) runs as plain TP. Decoding needs it
    (one new position at a time cannot be cut over TP ranks); the weights are the same tensors, nothing is copied.
    (A mixture of experts' router statistics: `moe.routing_alone`.)"""
    switched = [m for root in modules for m in root.modules() if getattr(m, "sequence_parallel", False) is True]
    for module in switched:
        module.sequence_parallel = False
    try:
        yield
    finally:
        for module in switched:
            module.sequence_parallel = True


class SequenceParallelDropout(nn.Module):
    """Dropout of a sequence shard whose mask is this rank's slice of one drawn for the whole sequence.

    Every TP rank draws the same full mask from the same generator state (the RNG stays in step across the TP
    group, which the replicated regions need) and keeps its slice, so the shards get independent masks, as in one
    process, instead of one mask repeated on every shard; activation checkpointing restores the generator state
    and redraws the same mask. On CPU the mask is bit-identical to `nn.Dropout`'s on the whole sequence."""

    def __init__(self, p: float, group):
        super().__init__()
        self.p, self.group = p, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        shape = list(x.shape)
        shape[SEQUENCE_DIM] *= dist.get_world_size(self.group)
        keep = x.new_empty(shape).bernoulli_(1.0 - self.p).div_(1.0 - self.p)
        return x * _sequence_slice(keep, self.group)


def _all_reduce_grad_hook(group):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook


def mark_sequence_parallel(param: nn.Parameter, group) -> None:
    """`param` is used on a sequence shard: sum its gradient over the TP group as autograd produces it."""
    if getattr(param, "sequence_parallel", False):
        return
    param.sequence_parallel = True
    sum_gradient_over(param, group)


def sum_gradient_over(param: nn.Parameter, group) -> None:
    """Each rank of `group` holds a copy of `param` that sees only its share of the work (a sequence slice, its
    heads): sum the copies' gradients as autograd produces them, before any optimizer, ZeRO bucket or clipping
    sees them, so the copies stay equal."""
    if param.requires_grad:
        param.register_hook(_all_reduce_grad_hook(group))


def check_sequence_length(seq_len: int, tensor_parallel: int) -> None:
    """Every TP rank holds an equal slice of the sequence."""
    if seq_len % tensor_parallel:
        raise MTNLGError(
            f"sequence_parallel: seq_len {seq_len} is not divisible by tensor_parallel {tensor_parallel}; "
            f"choose a seq_len that is a multiple of {tensor_parallel} or set sequence_parallel: false"
        )
