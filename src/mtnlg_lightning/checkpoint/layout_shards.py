"""Checkpoint I/O of the 3D strategy: one folder per checkpoint, one shard per rank of the layout that wrote it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mtnlg_lightning.errors import MTNLGError

_META_FILE = "meta.pt"


def save_layout_shards(strategy, checkpoint: dict, path: Path) -> None:
    """A folder: DeepSpeed's own files under ZeRO, else one `rank_XXXXX.pt` shard per rank; Lightning's
    loop/scheduler/callback state and `consumed_samples` in `meta.pt` (or DeepSpeed's client state)."""
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    if strategy.engine is not None:
        strategy.engine.save_checkpoint(str(path), client_state=meta, tag="checkpoint")
    else:
        if strategy.is_global_zero:
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
            torch.save(meta, path / _META_FILE)
        strategy.barrier()
        module = strategy.lightning_module
        torch.save(
            {"model": module.model.state_dict(), "optimizers": [o.state_dict() for o in strategy.optimizers]},
            path / f"rank_{strategy.global_rank:05d}.pt",
        )
    strategy.barrier()


def load_layout_shards(strategy, path: Path) -> dict[str, Any]:
    if strategy.engine is not None:
        _, client_state = strategy.engine.load_checkpoint(
            str(path),
            tag="checkpoint",
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            load_module_strict=True,
        )
        if client_state is None:
            raise MTNLGError(f"{path} holds no DeepSpeed checkpoint of this layout")
        return client_state
    shard_file = path / f"rank_{strategy.global_rank:05d}.pt"
    if not shard_file.exists():
        raise MTNLGError(f"{path} has no shard for rank {strategy.global_rank} (saved with another layout?)")
    shard = torch.load(shard_file, map_location=strategy.root_device, weights_only=False)
    strategy.lightning_module.model.load_state_dict(shard["model"])
    for optimizer, state in zip(strategy.optimizers, shard["optimizers"], strict=True):
        optimizer.load_state_dict(state)
    return torch.load(path / _META_FILE, map_location="cpu", weights_only=False)
