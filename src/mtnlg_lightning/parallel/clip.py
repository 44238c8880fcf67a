"""Gradient reduction over data-parallel replicas and clipping by the norm of the whole model (all TP shards, all
pipeline stages), as torchtitan's `dist_utils.clip_grad_norm_` does over its mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtnlg_lightning.parallel.expert_parallel import is_expert_parallel
from mtnlg_lightning.parallel.layout import ProcessGroups
from mtnlg_lightning.parallel.tensor_parallel import is_tensor_parallel
from mtnlg_lightning.torch_compat import flatten_dense_tensors, foreach_mul_, unflatten_dense_tensors


def all_reduce_data_parallel_grads(params: list[torch.Tensor], groups: ProcessGroups) -> None:
    """Average gradients over the data-parallel group in one flat buffer (no ZeRO: `zero_stage: 0`). An expert
    shard's gradient already sums its EP group's tokens (the all-to-all's backward): it is summed over the ranks
    holding the same experts (expert-data-parallel group) and divided by the whole DP size, as the others are."""
    experts = [p for p in params if is_expert_parallel(p)]
    dense = [p for p in params if not is_expert_parallel(p)]
    _average([p.grad for p in dense], groups.replica_group, groups.replica_size)
    _average([p.grad for p in experts], groups.expert_data_parallel_group, groups.replica_size)


def _average(grads: list[torch.Tensor], group, divisor: int) -> None:
    if divisor == 1 or not grads:
        return
    flat = flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= divisor
    for grad, reduced in zip(grads, unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(reduced)


def global_grad_norm(params: list[torch.Tensor], groups: ProcessGroups, device: torch.device) -> torch.Tensor:
    """L2 norm of the whole model's gradient: TP shards from every TP rank, TP-replicated parameters once (counted
    on TP rank 0), summed over the model-parallel group (TP x PP ranks of one replica)."""
    first_tp = groups.tensor_parallel_rank == 0
    counted = [p for p in params if is_tensor_parallel(p) or first_tp]
    squares = torch.zeros((), dtype=torch.float64, device=params[0].device if params else device)
    expert_squares = torch.zeros_like(squares)  # each expert lives on one rank of the EP group
    for param in counted:
        target = expert_squares if is_expert_parallel(param) else squares
        target += param.grad.detach().double().pow(2).sum()
    if groups.layout.expert_parallel > 1:
        dist.all_reduce(expert_squares, group=groups.expert_parallel_group)
    squares += expert_squares
    if groups.layout.model_parallel > 1:
        dist.all_reduce(squares, group=groups.model_parallel_group)
    return squares.sqrt().float()


def clip_grad_norm_(
    params: list[torch.Tensor], max_norm: float | None, groups: ProcessGroups, device: torch.device
) -> torch.Tensor:
    """DP-average the gradients, then scale them so the global norm is at most `max_norm` (None: no clipping).
    Returns the pre-clip global norm, the same on every rank."""
    params = [p for p in params if p.grad is not None]
    all_reduce_data_parallel_grads(params, groups)
    norm = global_grad_norm(params, groups, device)
    if max_norm:
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            foreach_mul_([p.grad for p in params], coef)
    return norm
