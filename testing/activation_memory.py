"""Activation memory as autograd keeps it: the bytes saved for the backward pass while each transformer block runs
forward (`torch.autograd.graph.saved_tensors_hooks`), distinct storages counted once, parameters excluded. Exact and
noise-free on CPU: benchmarks/bench_sequence_parallel_memory.py measures the layouts with it, and
tests/test_planner_activation_memory.py holds the planner's formulas against it."""

from __future__ import annotations


def saved_bytes_per_layer(model, tokens) -> list[int]:
    """Bytes saved for backward while each block runs its forward (distinct storages, parameters excluded)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    head = getattr(model.lm_head, "weight", None)
    if head is not None:
        params.add(head.untyped_storage().data_ptr())
    current: list[int | None] = [None]
    seen: set[int] = set()
    per_block = [0] * len(model.blocks)

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if current[0] is not None and key not in params and key not in seen:
            seen.add(key)
            per_block[current[0]] += storage.nbytes()
        return t

    def enter(i):
        return lambda *_: current.__setitem__(0, i)

    handles = []
    for i, block in enumerate(model.blocks.values()):
        handles.append(block.register_forward_pre_hook(enter(i)))
        handles.append(block.register_forward_hook(lambda *_: current.__setitem__(0, None)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    for handle in handles:
        handle.remove()
    return per_block
