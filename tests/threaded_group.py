"""Several ranks as threads of this process over torch's "threaded" process group (torch's own test utility), so
the tensor-parallel autograd functions are tested in one process, in milliseconds, with real collectives."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist


def run_ranks(world_size: int, fn) -> list:
    """fn(rank) on `world_size` threads inside one threaded process group; returns the results by rank."""
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg

    results, errors = [None] * world_size, []
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        _install_threaded_pg()
        store = dist.HashStore()

        def worker(rank: int) -> None:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                results[rank] = fn(rank)
            except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(error)
            finally:
                dist.destroy_process_group()

        threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    return results


def tensor_parallel_runs(reference, tokens: torch.Tensor, sequence_parallel: bool, size: int = 2, **forward) -> list:
    """(next-token loss, every trained parameter's gradient gathered whole) on each of `size` threaded ranks of a
    copy of `reference` split by `apply_tensor_parallel` (its LoRA adapters, if any, like their bases: the
    vocabulary-parallel loss); `forward`: the model's other arguments."""
    import copy

    from mtnlg_lightning.moe import moe_layers
    from mtnlg_lightning.parallel.lora import shard_with_adapters
    from mtnlg_lightning.parallel.tensor_parallel import (
        apply_tensor_parallel,
        gather_tensor_parallel,
        vocab_parallel_cross_entropy,
    )

    for _, layer in moe_layers(reference):
        layer.stats = None  # the last forward's (differentiable) statistics: not copied to the ranks

    def rank_fn(rank: int):
        group = dist.group.WORLD
        model = copy.deepcopy(reference)
        shard_with_adapters(
            model, lambda: apply_tensor_parallel(model, group, rank, size, sequence_parallel), rank, size
        )
        loss = vocab_parallel_cross_entropy(model(tokens[:, :-1], **forward), tokens[:, 1:], group)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            sharded = hasattr(p, "partition_dim") and p.partition_count > 1
            grads[name] = gather_tensor_parallel(p.grad, p.partition_dim, group) if sharded else p.grad
        return loss.detach(), grads

    return run_ranks(size, rank_fn)
