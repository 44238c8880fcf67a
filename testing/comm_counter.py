"""Count the bytes every torch.distributed call moves, per group kind (tp, dp, pp, mp, world) and operation.

`install()` wraps the collective and point-to-point functions in both `torch.distributed` and
`torch.distributed.distributed_c10d` (DeepSpeed calls some of each), so it must run before DeepSpeed builds its
communication backend. Only the outermost call is counted (`batch_isend_irecv` calls `isend`, `all_gather_object`
calls `all_gather`...). Bytes are the payload: the full buffer a collective reduces or gathers (all-reduce: the
tensor; reduce-scatter: its input; all-gather: its output), the tensor sent or received for point-to-point.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_state = threading.local()
counts: dict[tuple[str, str], int] = defaultdict(int)  # (group kind, op) -> bytes
calls: dict[tuple[str, str], int] = defaultdict(int)
_kinds: dict[int, str] = {}  # id(group) -> kind
_kinds_by_ranks: dict[tuple[int, ...], str] = {}
# One name per operation whatever the torch version calls it (torch >= 2.12 renamed the tensor collectives).
_CANONICAL = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def _nbytes(x) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


# op -> how to find (payload, group) in its arguments: the positional index of the payload and its keywords.
_PAYLOAD = {
    "all_reduce": (0, ("tensor",)),
    "reduce": (0, ("tensor",)),
    "broadcast": (0, ("tensor",)),
    "all_gather": (0, ("tensor_list",)),
    "all_gather_into_tensor": (0, ("output_tensor",)),
    "all_gather_single": (0, ("output_tensor",)),
    "_all_gather_base": (0, ("output_tensor",)),
    "reduce_scatter": (1, ("input_list",)),
    "reduce_scatter_tensor": (1, ("input",)),
    "reduce_scatter_single": (1, ("input",)),
    "_reduce_scatter_base": (1, ("input",)),
    "all_to_all_single": (1, ("input",)),
    "send": (0, ("tensor",)),
    "recv": (0, ("tensor",)),
    "isend": (0, ("tensor",)),
    "irecv": (0, ("tensor",)),
    "all_reduce_coalesced": (0, ("tensors",)),
}
_GROUP_POSITION = {
    "all_reduce": 2,
    "reduce": 3,
    "broadcast": 2,
    "all_gather": 2,
    "all_gather_into_tensor": 2,
    "all_gather_single": 2,
    "_all_gather_base": 2,
    "reduce_scatter": 3,
    "reduce_scatter_tensor": 3,
    "reduce_scatter_single": 3,
    "_reduce_scatter_base": 3,
    "send": 2,
    "recv": 2,
    "isend": 2,
    "irecv": 2,
    "all_reduce_coalesced": 2,
    "all_to_all_single": 4,
}


def register_groups(groups) -> None:
    """Name this rank's groups (a `ProcessGroups`): by identity first, then by member ranks (DeepSpeed may
    create its own group over the same ranks)."""
    for kind, attr in (
        ("tp", "tensor_parallel_group"),
        ("dp", "data_parallel_group"),
        ("pp", "pipeline_parallel_group"),
        ("mp", "model_parallel_group"),
    ):
        group = getattr(groups, attr, None)
        if group is not None:
            _kinds[id(group)] = kind
            _kinds_by_ranks.setdefault(tuple(dist.get_process_group_ranks(group)), kind)


def group_kind(group) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    if id(group) in _kinds:
        return _kinds[id(group)]
    try:
        ranks = tuple(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a group this rank is not in
        return "other"
    if len(ranks) == dist.get_world_size():
        return "world"
    return _kinds_by_ranks.get(ranks, "other")


def _wrap(name: str, fn):
    index, keywords = _PAYLOAD.get(name, (None, ()))

    def counted(*args, **kwargs):
        # Inside torch.compile'd code Dynamo traces this wrapper: the bookkeeping would be a side effect in the
        # graph (it breaks the capture under activation checkpointing). Compiled regions are not counted.
        if getattr(_state, "depth", 0) or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        _state.depth = 1
        try:
            if name == "batch_isend_irecv":
                ops = args[0] if args else kwargs["p2p_op_list"]
                for op in ops:
                    kind = group_kind(op.group)
                    op_fn = getattr(op.op, "__wrapped__", op.op)
                    key = (kind, getattr(op_fn, "__name__", str(op_fn)).lstrip("_"))
                    counts[key] += _nbytes(op.tensor)
                    calls[key] += 1
            else:
                payload = next((kwargs[k] for k in keywords if k in kwargs), None)
                if payload is None and index is not None and len(args) > index:
                    payload = args[index]
                position = _GROUP_POSITION.get(name)
                group = kwargs.get("group", args[position] if position is not None and len(args) > position else None)
                key = (group_kind(group), _CANONICAL.get(name, name).lstrip("_"))
                counts[key] += _nbytes(payload)
                calls[key] += 1
            return fn(*args, **kwargs)
        finally:
            _state.depth = 0

    counted.__wrapped__ = fn
    return counted


def install() -> None:
    # One wrapper per original function, set in both namespaces: torch checks `P2POp(op=...)` by identity
    # against `distributed_c10d.isend/irecv`, and callers pass `torch.distributed.isend`.
    for name in [*_PAYLOAD, "batch_isend_irecv"]:
        fn = getattr(c10d, name, None) or getattr(dist, name, None)
        if fn is None or getattr(fn, "_counted", False):
            continue
        wrapped = _wrap(name, fn)
        wrapped._counted = True
        for module in (dist, c10d):
            if getattr(module, name, None) is fn:
                setattr(module, name, wrapped)


def reset() -> None:
    counts.clear()
    calls.clear()


def snapshot() -> dict[str, dict[str, int]]:
    """{"tp/all_reduce": {"bytes": .., "calls": ..}, ...} since the last reset."""
    return {f"{kind}/{op}": {"bytes": counts[(kind, op)], "calls": calls[(kind, op)]} for kind, op in counts}
