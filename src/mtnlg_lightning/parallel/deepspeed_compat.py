"""Every DeepSpeed internal the project relies on, reached through this one module.

Two jobs need DeepSpeed's internals: running a backward that torch's pipeline schedule drives (not
`engine.backward`) under ZeRO-2, and reading or writing one parameter's slice of the ZeRO partitions for the
layout-independent checkpoints beyond what `deepspeed.utils.safe_get_full_*` offers (ZeRO-1/2 fragments without a
collective, re-linking the fragments after the moments are created). The version range is pinned in
`pyproject.toml`; `tests/test_framework_compat.py` lists every private name used here (with who needs it) and
checks them against the installed DeepSpeed: when a release moves one, it fails naming it, and this module is the
only place to change.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@contextmanager
def engine_backward(engine):
    """The bookkeeping `engine.backward` does around a backward, for backwards that a pipeline schedule runs
    (ZeRO-2 moves each micro-batch's gradients into its partitions from hooks that rely on it)."""
    engine.optimizer.clear_backward_seen_flag()
    engine._running_engine_backward = True
    engine._backward_prologue()
    try:
        yield
    finally:
        engine._backward_epilogue()
        engine._running_engine_backward = False


def moves_gradients_in_hooks(optimizer) -> bool:
    """bf16 ZeRO-1 (DeepSpeed's BF16_Optimizer with `immediate_grad_update`) moves each gradient into its fp32
    accumulation buffer from a backward hook."""
    return bool(getattr(optimizer, "immediate_grad_update", False))


# ------------------------------------------------------------------------------------------- ZeRO-3 parameters
def is_partitioned(param: torch.Tensor) -> bool:
    """A ZeRO-3 parameter: the tensor itself holds nothing between uses; its partition is `local_partition`."""
    return hasattr(param, "ds_id")


def local_partition(param: torch.Tensor) -> torch.Tensor:
    """This rank's partition of a ZeRO-3 parameter, else the parameter."""
    return getattr(param, "ds_tensor", param)


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape, also for a ZeRO-3 parameter (whose tensor is empty between uses)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def fp32_flat_partitions(optimizer) -> list[torch.Tensor] | None:
    """ZeRO-3's fp32 sub-group partitions (swapped in and out of the inner param groups at each step); None for
    other optimizers."""
    flats = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    return list(flats) if flats is not None else None


# ------------------------------------------------------------------------------------------- flat partitions
@dataclass(frozen=True)
class FlatPartition:
    """One flat fp32 partition a ZeRO optimizer hands its client optimizer as a parameter (ZeRO-1/2 and bf16
    ZeRO-1: one per param group; ZeRO-3: one per sub-group): the model parameters it partitions over `group`, in
    the same order on every rank of it, and this rank's `pieces` of them, each (index in `params`, offset in
    `flat`, start in the parameter's row-major elements, element count)."""

    flat: torch.Tensor
    params: list[torch.Tensor]
    group: object
    pieces: list[tuple[int, int, int, int]]


def flat_partitions(optimizer) -> list[FlatPartition]:
    """The flat partitions of a ZeRO optimizer (DeepSpeed's ZeRO-1/2, its bf16 ZeRO-1 `BF16_Optimizer` or ZeRO-3),
    where each of its parameters' pieces lies."""
    if fp32_flat_partitions(optimizer) is not None:  # ZeRO-3: each parameter cut evenly over its group
        partitions = []
        for index, params in enumerate(optimizer.fp16_groups):
            group = optimizer.sub_group_process_groups[index]
            rank, pieces = dist.get_rank(group), []
            for number, param in enumerate(params):
                _, offset, size = optimizer.grad_position[optimizer.get_param_id(param)]
                count = max(0, min(size, param.ds_numel - rank * size))
                if count:
                    pieces.append((number, offset, rank * size, count))
            partitions.append(FlatPartition(optimizer.fp32_partitioned_groups_flat[index], params, group, pieces))
        return partitions
    if hasattr(optimizer, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        flats, groups = optimizer.single_partition_of_fp32_groups, optimizer.bit16_groups
    else:  # bf16 ZeRO-1
        flats, groups = optimizer.fp32_groups_flat_partition, optimizer.bf16_groups
    partitions = []
    for index, (flat, params) in enumerate(zip(flats, groups, strict=True)):
        pieces = []
        for number, param in enumerate(params):
            mapping = fragment_mapping(param)
            if mapping is not None:
                lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
                pieces.append((number, hp.start, lp.start, lp.numel))
        partitions.append(FlatPartition(flat, list(params), optimizer.real_dp_process_group[index], pieces))
    return partitions


# ------------------------------------------------------------------------------------------- ZeRO-1/2 fragments
def fragment_mapping(param: torch.Tensor):
    """ZeRO-1/2's map from a parameter to its flat range in this rank's partition (`lp_fragment_address` with
    `start` and `numel`, `get_optim_state_fragment(name)`); None where this rank's partition holds none of it, or
    for a parameter DeepSpeed does not map."""
    return getattr(param, "_hp_mapping", None)


def has_fragment_mapping(param: torch.Tensor) -> bool:
    return hasattr(param, "_hp_mapping")


def relink_moment_fragments(optimizer) -> None:
    """ZeRO-1/2 give each parameter views into the moments of its flat partition only when asked (and may have
    been asked before the moments existed): (re)link them."""
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


# ------------------------------------------------------------------------------------------- expert parallelism
def expert_group_name(expert_parallel: int) -> str:
    """DeepSpeed's key for an expert-parallel group (it parses the size back out of it)."""
    return f"ep_size_{expert_parallel}"


def register_expert_groups(name: str, groups) -> None:
    """Hand our EP and expert-data-parallel groups to DeepSpeed under `name`, where its ZeRO optimizers look them
    up (`deepspeed.utils.groups`), instead of DeepSpeed making its own with its own rank order."""
    from deepspeed.utils import groups as ds_groups  # optional extra [deepspeed]: imported on use

    ds_groups._EXPERT_PARALLEL_GROUP[name] = groups.expert_parallel_group
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = groups.ranks["ep"]
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = groups.expert_data_parallel_group
    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = groups.ranks["edp"]


def mark_expert_parameters(params, name: str, expert_data_parallel_group, zero_stage: int) -> None:
    """Tell ZeRO that `params` are experts of the EP group `name`: ZeRO-1/2 reduce their gradients and partition
    their optimizer state over the expert-data-parallel group (DeepSpeed-MoE's `allreduce=False` and `group_name`),
    ZeRO-3 partitions the parameters themselves over it and averages their gradients over the whole DP size
    (AutoEP's placement, which DeepSpeed >= 0.19 gives ZeRO-3)."""
    for param in params:
        param.allreduce, param.group_name = False, name
        if zero_stage == 3:
            param.ds_zero_placement_family = "autoep_expert"
            param.ds_zero_partition_group_name = name
            param.ds_zero_partition_process_group = expert_data_parallel_group
            param.ds_zero_partition_rank = dist.get_rank(group=expert_data_parallel_group)
            param.ds_zero_partition_world_size = dist.get_world_size(group=expert_data_parallel_group)


@contextmanager
def engine_with_experts(enabled: bool):
    """DeepSpeed's engine sets `has_moe_layers` (which ZeRO-1/2 need to treat expert groups apart) only when it
    finds its own MoE module class: while building an engine, say it for a model whose experts we marked."""
    if not enabled:
        yield
        return
    from deepspeed.runtime.engine import DeepSpeedEngine  # optional extra [deepspeed]: imported on use

    original = DeepSpeedEngine._configure_distributed_model

    def configure(self, model):
        original(self, model)
        self.has_moe_layers = True

    DeepSpeedEngine._configure_distributed_model = configure
    try:
        yield
    finally:
        DeepSpeedEngine._configure_distributed_model = original


# ------------------------------------------------------------------------------------------- ZeRO-3 decoding
@contextmanager
def whole_parameters_without_hooks(engine):
    """A ZeRO-3 engine's parameters gathered whole on every rank, its per-module fetch and release hooks removed,
    for a while: decoding runs as many forward passes as its own sequences need, which differ between the data-
    parallel ranks, so the hooks' per-module all-gathers would not meet. The hooks are registered again (and the
    prefetch trace invalidated) on the way out, then the parameters partitioned again. TRL's
    `unwrap_model_for_generation` does the same (`remove_hooks` / `add_hooks`)."""
    import deepspeed  # optional extra [deepspeed]: imported on use (a ZeRO-3 engine)

    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    params = list(offload.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        for param in params:
            param.ds_active_sub_modules.clear()
        for hook in [*offload.forward_hooks, *offload.backward_hooks]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)  # it invalidates the prefetch trace itself
