"""The same format for Lightning's own strategies (one process, DDP): a `CheckpointIO` that writes the module's
model-space pieces and reads any layout's checkpoint back into Lightning's checkpoint dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from mtnlg_lightning.checkpoint.commit import prepare_staging, remove_checkpoint
from mtnlg_lightning.checkpoint.format import CheckpointError, TensorReader
from mtnlg_lightning.checkpoint.model_space import model_slots
from mtnlg_lightning.checkpoint.sharded import (
    check_checkpoint,
    checkpoint_header,
    module_buffers,
    write_and_publish,
)
from mtnlg_lightning.checkpoint.state_io import (
    MOMENTS,
    buffer_pieces,
    check_same_optimizer,
    collect_pieces,
    weight_key,
)
from mtnlg_lightning.parallel.muon import MOMENTUM_BUFFER
from mtnlg_lightning.train.optimizer_recipe import optimizer_groups

SINGLE_PROCESS = {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1, "zero_stage": 0}


class ModelSpaceCheckpointIO(CheckpointIO):
    """Installed by `MTNLGModule.setup` on Lightning's single-device and DDP strategies (rank 0 saves)."""

    def __init__(self, module):
        self.module = module

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        module = self.module
        path = Path(path)
        staging = prepare_staging(path)
        optimizer = module.trainer.optimizers[0] if module.trainer.optimizers else None
        slots = model_slots(module.model, module.config)
        pieces = collect_pieces(slots, optimizer, None, lambda index, slot: True)
        pieces += buffer_pieces(module_buffers(module))
        header = checkpoint_header(module, checkpoint, optimizer, SINGLE_PROCESS)
        write_and_publish(staging, path, "rank-00000.safetensors", pieces, header, alone=True)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        path = Path(path)
        if path.is_file():  # a plain Lightning checkpoint file (tensors and plain types only)
            try:
                return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=True)
            except Exception as error:  # noqa: BLE001 - not a checkpoint: one line
                raise CheckpointError(f"{path} is not a readable checkpoint file ({type(error).__name__})") from None
        module = self.module
        slots = model_slots(module.model, module.config)
        manifest, meta = check_checkpoint(path, slots, module.config, rank=0, world=1)
        reader = TensorReader(path, manifest)
        state_dict, by_name = {}, {}
        for slot in slots:
            key = weight_key(reader, slot.name, slot.param.dtype)
            local = torch.zeros(slot.param.shape, dtype=slot.param.dtype)
            slot.fill(local, reader.read(key, slot.offsets, slot.shape, dtype=slot.param.dtype))
            by_name[slot.name] = local
        for name, param in module.model.named_parameters(remove_duplicate=False):
            if name in by_name:
                state_dict[f"model.{name}"] = by_name[name]
            elif not param.requires_grad:  # frozen (a LoRA base): not stored, the run rebuilt it from its base
                state_dict[f"model.{name}"] = param.detach()
            else:  # the tied head
                state_dict[f"model.{name}"] = by_name["embed.wte.weight"]
        for name, buffer in module_buffers(module):  # checked present: `config_mismatch` expects them
            state_dict[f"model.{name}"] = reader.read(f"model/{name}", dtype=buffer.dtype)
        checkpoint = {**meta, "state_dict": state_dict}
        optimizer = meta.get("optimizer")
        if module.hparams.get("reset_optimizer"):  # Lightning restores these: a fresh optimizer's and schedule's
            fresh = module.configure_optimizers()
            checkpoint["optimizer_states"] = [fresh["optimizer"].state_dict()]
            checkpoint["lr_schedulers"] = [fresh["lr_scheduler"]["scheduler"].state_dict()]
        elif optimizer and optimizer.get("step") is not None:
            check_same_optimizer(optimizer, module.hparams.get("optimizer", "adamw"))
            checkpoint["optimizer_states"] = [_torch_optimizer_state(module, reader, slots, optimizer)]
        return checkpoint

    def remove_checkpoint(self, path) -> None:
        remove_checkpoint(path)


def _torch_optimizer_state(module, reader: TensorReader, slots, optimizer: dict) -> dict:
    """The `state_dict()` of the optimizer `configure_optimizers` builds (parameters numbered in its order): AdamW's
    moments and step, or Muon's momentum buffer in its groups."""
    slot_of = {id(s.param): s for s in slots}
    state, param_groups, index = {}, [], 0
    groups = optimizer_groups(module.model, module.hparams.get("optimizer", "adamw"))
    for params, saved in zip(groups, optimizer["param_groups"], strict=True):
        ids = []
        for param in params:
            slot = slot_of[id(param)]
            muon = saved.get("muon")
            entry = {} if muon else {"step": torch.tensor(float(optimizer["step"]))}
            for moment in (MOMENTUM_BUFFER,) if muon else MOMENTS:
                local = torch.zeros(param.shape, dtype=torch.float32)
                slot.fill(local, reader.read(f"optim/{slot.name}/{moment}", slot.offsets, slot.shape))
                entry[moment] = local
            state[index] = entry
            ids.append(index)
            index += 1
        param_groups.append({**saved, "params": ids})
    return {"state": state, "param_groups": param_groups}
