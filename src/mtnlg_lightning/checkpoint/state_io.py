"""Per-parameter training state (weights, fp32 master, Adam moments, Muon's momentum buffer) between live objects
and model-space pieces.

Two owners of that state: a torch optimizer over the (sharded) model parameters, or a DeepSpeed ZeRO engine
whose fp32 master and moments are flat partitions over the data-parallel group, reached per parameter through
DeepSpeed's tensor-fragment API (`deepspeed.utils.safe_get_full_*` / `safe_set_full_*`).
"""

from __future__ import annotations

import torch

from mtnlg_lightning.checkpoint.format import CheckpointError, Piece, TensorReader
from mtnlg_lightning.checkpoint.model_space import Slot
from mtnlg_lightning.checkpoint.validate import MOMENTS, STATE_KEYS
from mtnlg_lightning.parallel.deepspeed_compat import (
    fp32_flat_partitions,
    fragment_mapping,
    full_shape,
    has_fragment_mapping,
    is_partitioned,
    relink_moment_fragments,
)
from mtnlg_lightning.parallel.muon import MOMENTUM_BUFFER, MuonAdamW
from mtnlg_lightning.parallel.zero import base_optimizer


def _step_of(optimizer) -> float | None:
    """The optimizer's update count (AdamW keeps one per parameter; they are all equal here)."""
    inner = base_optimizer(optimizer)
    for state in inner.state.values():
        if "step" in state:
            return float(state["step"])
    return None


# A group's parameters, and DeepSpeed's marks of an expert group (its EP group's name): the layout's, not the run's.
LAYOUT_KEYS = ("params", "moe", "name")


def optimizer_name(optimizer) -> str:
    """`muon` (Muon with AdamW, `parallel/muon.py`) or `adamw`: what `model.optimizer` names."""
    return "muon" if isinstance(base_optimizer(optimizer), MuonAdamW) else "adamw"


def recorded_groups(optimizer) -> list[dict]:
    """The param groups a checkpoint records, in order: Muon's every group, empty ones too (which DeepSpeed drops
    from the optimizer it steps), so that they are the same in every layout."""
    inner = base_optimizer(optimizer)
    return inner.recorded_groups if isinstance(inner, MuonAdamW) else inner.param_groups


def optimizer_meta(optimizer) -> dict:
    """Which optimizer, the hyper-parameters of each param group (lr, betas, weight decay ...), the update count."""
    groups = [{k: v for k, v in g.items() if k not in LAYOUT_KEYS} for g in recorded_groups(optimizer)]
    return {"name": optimizer_name(optimizer), "param_groups": groups, "step": _step_of(optimizer)}


def stepping_replicas(optimizer, slots: list[Slot], writers: list[int]) -> list[int]:
    """The replica writing each slot (`writers`, one per slot), except that a Muon matrix stepped by one replica
    only is written by that one, which holds its momentum buffer."""
    inner = base_optimizer(optimizer) if optimizer is not None else None
    owners = inner.owners if isinstance(inner, MuonAdamW) else {}
    return [owners.get(slot.param, writer) for slot, writer in zip(slots, writers, strict=True)]


def check_same_optimizer(meta: dict, name: str) -> None:
    """A checkpoint's optimizer state only fits the optimizer that wrote it (checkpoints before Muon: AdamW)."""
    saved = meta.get("name", "adamw")
    if saved != name:
        raise CheckpointError(
            f"the checkpoint's optimizer is {saved} and this run's {name}: resume with --model.optimizer {saved}, "
            "or set --model.reset_optimizer true to start the optimizer afresh"
        )


def restore_optimizer_meta(optimizer, meta: dict) -> None:
    groups = recorded_groups(optimizer)
    saved = meta["param_groups"]
    if len(saved) != len(groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} param groups, this one {len(groups)}")
    for group, values in zip(groups, saved, strict=True):
        for key, value in values.items():
            if key in group and key not in LAYOUT_KEYS:
                group[key] = value


def state_keys(optimizer, param: torch.Tensor) -> tuple[str, ...]:
    """The optimizer state a checkpoint stores for a parameter (or a ZeRO partition): Muon's momentum buffer for
    the matrices Muon steps, else AdamW's moments."""
    inner = base_optimizer(optimizer) if optimizer is not None else None
    return (MOMENTUM_BUFFER,) if isinstance(inner, MuonAdamW) and inner.is_muon(param) else MOMENTS


def _fresh_adam_state(param: torch.Tensor, group: dict, step: float) -> dict:
    """AdamW's state as torch creates it lazily at the first step (so a step right after loading finds it)."""
    on_device = group.get("capturable") or group.get("fused")
    dtype = torch.float32 if on_device else torch.get_default_dtype()
    step_tensor = torch.tensor(step, dtype=dtype, device=param.device if on_device else "cpu")
    return {
        "step": step_tensor,
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }


# ------------------------------------------------------------------------------------------------ collect
def collect_pieces(
    slots: list[Slot], optimizer, engine, writer_of, data_parallel_size: int = 1, tp_rank: int = 0, snapshot=False
) -> list[Piece]:
    """This rank's pieces. `writer_of(index, slot)` says whether this rank writes parameter `index` whole (one
    data-parallel replica, and TP rank 0 for TP-replicated tensors). Under ZeRO-1/2 each rank writes the Adam-moment
    fragments it owns as flat ranges, with no communication, where they are contiguous in model space; the other
    moments (ZeRO-3, column-split shards) are gathered, a collective every data-parallel rank joins in order.
    `snapshot`: every piece is a copy in host memory (a CPU tensor's `.cpu()` is the tensor itself), for a write
    that happens while training goes on."""
    initialized = engine is not None and _deepspeed_state_initialized(engine)
    if initialized:
        relink_moment_fragments(engine.optimizer)
    pieces = []
    for index, slot in enumerate(slots):
        writes = writer_of(index, slot) and not slot.empty
        flat = initialized and data_parallel_size > 1 and _flat_in_model_space(slot)
        for key, tensor in _full_local_states(slot, optimizer, engine, data_parallel_size, moments=not flat):
            if writes and tensor is not None:
                host = slot.stored(tensor).detach().to("cpu", copy=snapshot)
                pieces.append(Piece(key, host, slot.offsets, slot.global_shape))
        if flat and slot.tp_writer:
            pieces += _moment_fragments(slot, state_keys(optimizer, slot.param))
    return pieces


def buffer_pieces(buffers: list[tuple[str, torch.Tensor]], snapshot=False) -> list[Piece]:
    """The pieces of `model_space.model_buffers`, each whole (the caller picks the one rank that writes them)."""
    pieces = []
    for name, buffer in buffers:
        host = buffer.detach().to("cpu", copy=snapshot)
        pieces.append(Piece(f"model/{name}", host, (0,) * buffer.dim(), tuple(buffer.shape)))
    return pieces


@torch.no_grad()
def restore_buffers(reader: TensorReader, buffers: list[tuple[str, torch.Tensor]]) -> None:
    """Every rank fills the buffers it holds from the checkpoint (the caller checked they are there)."""
    for name, buffer in buffers:
        value = reader.read(f"model/{name}", (0,) * buffer.dim(), tuple(buffer.shape), dtype=buffer.dtype)
        buffer.copy_(value.to(buffer.device))


def _flat_in_model_space(slot: Slot) -> bool:
    """A ZeRO-1/2 fragment (a flat range of this rank's shard) is a flat range of the model-space tensor when the
    shard is whole rows of it: TP-replicated, or split along the first dimension."""
    param = slot.param
    if is_partitioned(param) or not has_fragment_mapping(param):
        return False
    return slot.replicated_over_tp or getattr(param, "partition_dim", 0) == 0


def _moment_fragments(slot: Slot, moments: tuple[str, ...]) -> list[Piece]:
    mapping = fragment_mapping(slot.param)
    if mapping is None:  # this rank's ZeRO partition holds none of this parameter
        return []
    row = slot.param[0].numel() if slot.param.dim() > 1 else 1
    stored = slot.shape[0] * row  # vocabulary padding rows are not stored
    start, count = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
    end = min(start + count, stored)
    if end <= start:
        return []
    pieces = []
    for moment in moments:
        fragment = mapping.get_optim_state_fragment(moment)[: end - start]
        key = f"optim/{slot.name}/{moment}"
        pieces.append(Piece(key, fragment.detach().cpu().clone(), (), slot.global_shape, slot.offsets[0] * row + start))
    return pieces


def _full_local_states(slot: Slot, optimizer, engine, data_parallel_size: int, moments: bool = True):
    """(key, this rank's full local tensor) for the weight, the master weight and the moments of one parameter."""
    param = slot.param
    if engine is None:
        yield f"model/{slot.name}", param.data
        state = base_optimizer(optimizer).state.get(param, {}) if optimizer is not None else {}
        for moment in STATE_KEYS:
            if moment in state:
                yield f"optim/{slot.name}/{moment}", state[moment]
        return
    # optional extra [deepspeed]: imported on use (only a ZeRO engine reaches here)
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero3 = is_partitioned(param)
    if param.dtype == torch.float32 and not zero3:
        yield f"model/{slot.name}", param.data  # ZeRO-1/2 keep every weight whole; fp32: equal to the master
    else:
        master = safe_get_full_fp32_param(param)  # collective over the data-parallel group
        yield f"model/{slot.name}", master.to(param.dtype)
        if param.dtype != torch.float32:
            yield f"master/{slot.name}", master
    if not moments:
        return
    initialized = _deepspeed_state_initialized(engine)
    mapping = fragment_mapping(param)
    whole = data_parallel_size == 1 and mapping is not None and mapping.lp_fragment_address.numel == param.numel()
    for moment in state_keys(engine.optimizer, param):
        if not initialized:
            yield f"optim/{slot.name}/{moment}", None
        elif whole:  # one replica: this rank's fragment is the whole parameter, no collective needed
            yield f"optim/{slot.name}/{moment}", mapping.get_optim_state_fragment(moment).view_as(param)
        else:
            yield f"optim/{slot.name}/{moment}", safe_get_full_optimizer_state(param, moment)


def _deepspeed_state_initialized(engine) -> bool:
    inner = base_optimizer(engine.optimizer)
    return any("exp_avg" in s for s in inner.state.values())


# ------------------------------------------------------------------------------------------------ restore
def restore_pieces(reader: TensorReader, slots: list[Slot], optimizer, engine, meta: dict, groups=None) -> None:
    """Load every slot's weight (and, with an optimizer, its master weight and moments) from the checkpoint."""
    step = meta.get("step")
    if engine is None:
        _restore_torch(reader, slots, optimizer, step)
    else:
        stored = (f"optim/{s.name}/{state_keys(engine.optimizer, s.param)[0]}" in reader for s in slots if not s.empty)
        has_moments = step is not None and all(stored)
        _restore_deepspeed(reader, slots, engine, step, has_moments, groups)


def _read_local(reader: TensorReader, key: str, slot: Slot, dtype: torch.dtype, device) -> torch.Tensor:
    """This rank's full local tensor of `key` (its TP shard, padding rows zero), whatever layout wrote it."""
    local = torch.zeros(full_shape(slot.param), dtype=dtype)
    if not slot.empty:
        slot.fill(local, reader.read(key, slot.offsets, slot.shape, dtype=dtype))
    return local.to(device)


def weight_key(reader: TensorReader, name: str, dtype: torch.dtype) -> str:
    """The fp32 master where the checkpoint has one and the target keeps fp32; else the weights."""
    master = f"master/{name}"
    return master if dtype == torch.float32 and master in reader else f"model/{name}"


@torch.no_grad()
def _restore_torch(reader, slots, optimizer, step) -> None:
    """The weights, and with an optimizer each parameter's state as its group keeps it: Adam's moments (and the
    step), or Muon's momentum buffer. The state is restored only when the checkpoint holds all of it."""
    inner = base_optimizer(optimizer) if optimizer is not None else None
    group_of = {id(p): g for g in (inner.param_groups if inner else []) for p in g["params"]}

    stored = (f"optim/{s.name}/{k}" in reader for s in slots if not s.empty for k in state_keys(inner, s.param))
    has_state = inner is not None and step is not None and all(stored)
    for slot in slots:
        param = slot.param
        key = weight_key(reader, slot.name, param.dtype)
        param.data.copy_(_read_local(reader, key, slot, param.dtype, param.device))
        if not has_state:
            continue
        group = group_of[id(param)]
        if group.get("muon") and not inner.owns(param):  # another data-parallel replica steps it
            continue
        state = (
            {MOMENTUM_BUFFER: torch.zeros_like(param)} if group.get("muon") else _fresh_adam_state(param, group, step)
        )
        for moment in state_keys(inner, param):
            value = _read_local(reader, f"optim/{slot.name}/{moment}", slot, state[moment].dtype, param.device)
            state[moment].copy_(value)
        inner.state[param] = state


@torch.no_grad()
def _restore_deepspeed(reader, slots, engine, step, has_moments, groups) -> None:
    # optional extra [deepspeed]: imported on use (only a ZeRO engine reaches here)
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    zero3 = any(is_partitioned(s.param) for s in slots)
    masters = []
    for slot in slots:
        key = weight_key(reader, slot.name, torch.float32)
        masters.append(_read_local(reader, key, slot, torch.float32, engine.device))
    if zero3:
        _set_zero3_weights(slots, masters, groups)
    else:
        for slot, master in zip(slots, masters, strict=True):
            slot.param.data.copy_(master.view_as(slot.param).to(slot.param.dtype))
    for slot, master in zip(slots, masters, strict=True):
        safe_set_full_fp32_param(slot.param, master)  # this rank's fragment of the fp32 partition
    if not has_moments:
        return
    _ensure_deepspeed_state(engine, step)
    for slot in slots:
        for moment in state_keys(engine.optimizer, slot.param):
            value = _read_local(reader, f"optim/{slot.name}/{moment}", slot, torch.float32, engine.device)
            safe_set_full_optimizer_state(slot.param, value, moment)


def _set_zero3_weights(slots, masters, groups) -> None:
    """ZeRO-3 partitions the parameters themselves: gather, assign the same full value on every data-parallel
    rank, and let DeepSpeed re-partition from the group's first rank."""
    import deepspeed  # optional extra [deepspeed]: imported on use

    src = groups.layout.rank(groups.coord.pp, 0, groups.coord.tp) if groups is not None else 0
    params = [s.param for s in slots]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=src):
        for param, master in zip(params, masters, strict=True):
            param.data.copy_(master.view_as(param.data).to(param.dtype))


def _ensure_deepspeed_state(engine, step: float) -> None:
    """Adam's moments (and Muon's momentum buffer) exist only after the first step; create them (zeros, the saved
    step) so the per-parameter setters have somewhere to write, and link DeepSpeed's fragments to them."""
    optimizer = engine.optimizer
    inner = base_optimizer(optimizer)
    # ZeRO-3 swaps its fp32 sub-group partitions in and out of the inner param groups at each step: take them all.
    flats = fp32_flat_partitions(optimizer)
    flats = flats if flats is not None else [p for g in inner.param_groups for p in g["params"]]
    for flat in flats:
        state = inner.state.get(flat)
        if state_keys(inner, flat) == (MOMENTUM_BUFFER,):  # a partition of Muon matrices: its momentum buffer
            inner.state[flat] = {MOMENTUM_BUFFER: torch.zeros_like(flat)} if not state else state
        elif not state or "exp_avg" not in state:
            inner.state[flat] = _fresh_adam_state(flat, inner.param_groups[0], step)
        else:
            state["step"].fill_(step)
    relink_moment_fragments(optimizer)
