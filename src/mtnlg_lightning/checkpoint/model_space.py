"""Where each local parameter sits in model space: the single-process name, the global (unpadded) shape and the
box this rank's tensor covers, whatever the TP / PP layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.model import persistent_buffers
from mtnlg_lightning.parallel.deepspeed_compat import full_shape
from mtnlg_lightning.parallel.expert_parallel import is_expert_parallel
from mtnlg_lightning.parallel.pipeline import PipelineChunks

VOCAB_PARAMS = ("embed.wte.weight", "lm_head.weight")  # rows = the vocabulary, padded in memory, not on disk
# What tensor parallelism writes on a parameter about its shard (`parallel/tensor_parallel.py`).
PARALLEL_MARKS = ("tensor_model_parallel", "partition_dim", "partition_stride", "partition_index", "partition_count")
PARALLEL_MARKS += ("expert_parallel_index", "expert_parallel_count")  # a run of stacked experts (expert parallelism)


@dataclass
class Slot:
    """One local parameter and its box in model space. `rows` is how many leading rows of the local tensor along
    the partition dim are real (vocabulary padding beyond them is not stored and loads as zeros)."""

    name: str
    param: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]  # the stored part of the local tensor (<= its shape)
    replicated_over_tp: bool  # every TP rank holds the whole tensor
    tp_writer: bool = True  # this TP rank is the one that saves the box (a replicated box is saved once)

    @property
    def empty(self) -> bool:
        return any(s == 0 for s in self.shape)

    def stored(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of a local tensor (the parameter or one of its optimizer states) that is stored."""
        return tensor[tuple(slice(0, s) for s in self.shape)]

    def fill(self, local: torch.Tensor, value: torch.Tensor) -> None:
        """Copy a box read from disk into a local tensor, zeroing the vocabulary padding."""
        if tuple(value.shape) != tuple(local.shape):
            local.zero_()
        local[tuple(slice(0, s) for s in self.shape)].copy_(value)


def global_name(name: str, chunked: bool) -> str:
    """`PipelineChunks` prefixes each virtual stage's names with its index; block names are global already."""
    return name.split(".", 1)[1] if chunked else name


def model_slots(model: nn.Module, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> list[Slot]:
    """A slot per trained parameter of this rank's part of the model, in `named_parameters` order (the same on
    every data-parallel replica of this part). A frozen parameter (a LoRA run's base) is no training state: the
    run rebuilds it from the base its checkpoint names."""
    chunked = isinstance(model, PipelineChunks)
    slots = []
    for local_name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        name = global_name(local_name, chunked)
        sharded = hasattr(param, "partition_dim") and tp_size > 1
        shape = full_shape(param)  # ZeRO-3 partitions the tensor itself
        offsets = [0] * len(shape)
        global_shape = list(shape)
        stored = list(shape)
        if sharded:  # shard `partition_index` of `partition_count` (fewer shards than TP ranks: shared copies)
            dim = param.partition_dim
            offsets[dim] = param.partition_index * shape[dim]
            global_shape[dim] = shape[dim] * param.partition_count
        if is_expert_parallel(param):  # a run of the stacked experts
            offsets[0] = param.expert_parallel_index * shape[0]
            global_shape[0] = shape[0] * param.expert_parallel_count
        if name in VOCAB_PARAMS:  # trim the padded vocabulary to the real one
            global_shape[0] = config.vocab_size
            stored[0] = max(0, min(shape[0], config.vocab_size - offsets[0]))
        writer = bool(getattr(param, "tensor_model_parallel", False)) if sharded else tp_rank == 0
        slots.append(Slot(name, param, tuple(global_shape), tuple(offsets), tuple(stored), not sharded, writer))
    return slots


def model_buffers(model: nn.Module, frozen_base: bool = False) -> list[tuple[str, torch.Tensor]]:
    """(model-space name, tensor) of every persistent buffer of this rank's part of the model
    (`model.persistent_buffers`): whole and equal on every rank holding its block, so one rank writes each. None in
    a run that trains adapters over a `frozen_base`: like the frozen weights, they are its base's."""
    if frozen_base:
        return []
    chunked = isinstance(model, PipelineChunks)
    return [(global_name(name, chunked), buffer) for name, buffer in persistent_buffers(model)]
