"""Save and load of the 3D strategy: every rank writes its own model-space pieces in parallel (each tensor once),
rank 0 publishes the manifest last; any layout loads any checkpoint."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mtnlg_lightning.checkpoint.commit import prepare_staging, publish, staging_path
from mtnlg_lightning.checkpoint.format import (
    TOKENIZER,
    CheckpointError,
    TensorReader,
    is_checkpoint,
    listed_chat,
    read_manifest,
    read_meta,
    verify_files,
    write_carried,
    write_manifest,
    write_meta,
    write_pieces,
)
from mtnlg_lightning.checkpoint.model_space import Slot, model_buffers, model_slots
from mtnlg_lightning.checkpoint.state_io import (
    buffer_pieces,
    check_same_optimizer,
    collect_pieces,
    optimizer_meta,
    optimizer_name,
    restore_buffers,
    restore_optimizer_meta,
    restore_pieces,
    stepping_replicas,
)
from mtnlg_lightning.checkpoint.validate import config_mismatch
from mtnlg_lightning.data.chat_template import directory_template_files
from mtnlg_lightning.parallel.expert_parallel import is_expert_parallel

LIGHTNING_TENSOR_KEYS = ("state_dict", "optimizer_states")


def _all_gather(obj, group=None) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _first_error(errors: list[str | None]) -> str | None:
    found = sorted(e for e in errors if e)
    return found[0] if found else None


def tokenizer_of(trainer) -> str | None:
    datamodule = getattr(trainer, "datamodule", None)
    return getattr(datamodule, "tokenizer_file", None)


def chat_files_of(trainer) -> dict[str, bytes]:
    """The chat template a checkpoint carries: the one the fine-tuning data was rendered with, else the one of the
    model the run started from (`init_from`: a Hugging Face directory, or a checkpoint carrying one). Copied, not
    referred to: the checkpoint serves chats after that directory has moved or changed (a full fine-tune needs
    nothing else of it), and its manifest hashes what it carries."""
    chat = getattr(getattr(trainer, "datamodule", None), "chat", None)
    if chat is not None:
        return chat.carried_files()
    init_from = trainer.lightning_module.hparams.get("init_from")
    if not init_from:
        return {}
    if is_checkpoint(init_from):
        folder = listed_chat(Path(init_from), read_manifest(Path(init_from)))
        return directory_template_files(folder) if folder is not None else {}
    return directory_template_files(init_from)


def carried_files(trainer) -> dict[str, bytes]:
    """The small files a checkpoint carries beside its tensors: the tokenizer and the chat template (read now: a
    background writer writes them later)."""
    tokenizer = tokenizer_of(trainer)
    files = {TOKENIZER: Path(tokenizer).read_bytes()} if tokenizer and Path(tokenizer).is_file() else {}
    return {**files, **chat_files_of(trainer)}


def checkpoint_info(module, trainer, layout: dict) -> dict:
    info = {
        "global_step": int(trainer.global_step),
        "consumed_samples": int(module.consumed_samples),
        "model_config": dataclasses.asdict(module.config),
        "saved_by": layout,
    }
    return {**info, **module.manifest_entries()}  # what the run's extensions add (LoRA: its settings)


def module_buffers(module) -> list:
    """The model-space buffers of a training module's part of the model (`model_space.model_buffers`)."""
    return model_buffers(module.model, frozen_base=module.frozen_base)


def balanced_owners(slots: list[Slot], replicas: int) -> list[int]:
    """Which data-parallel replica writes each parameter: largest first to the least loaded (the same answer on
    every rank), so the replicas write about equal bytes in parallel."""
    load = [0] * replicas
    owner = [0] * len(slots)
    for index in sorted(range(len(slots)), key=lambda i: (-slots[i].param.numel(), i)):
        target = min(range(replicas), key=lambda r: (load[r], r))
        owner[index] = target
        load[target] += max(slots[index].param.numel(), int(getattr(slots[index].param, "ds_numel", 0)))
    return owner


def save_sharded(strategy, checkpoint: dict, path: Path, background=None) -> None:
    """Every rank writes its pieces, rank 0 the manifest last and publishes. With `background` (a
    `BackgroundSaver`), the pieces are copied to host memory here and written, gathered and published by its writer
    thread over its own process group, while training goes on."""
    module, groups = strategy.lightning_module, strategy.groups
    if background is not None:
        background.wait()  # at most one save in flight
        if is_checkpoint(path) and read_manifest(path).get("global_step") == module.trainer.global_step:
            return  # this step was just published by the save in flight (e.g. a preemption save after a periodic one)
    if strategy.is_global_zero:
        prepare_staging(path)
    strategy.barrier()
    staging = staging_path(path)
    slots = model_slots(module.model, module.config, groups.tensor_parallel_rank, groups.tensor_parallel_size)
    optimizer = strategy.optimizers[0] if strategy.optimizers else None
    owner = balanced_owners(slots, groups.replica_size)  # DP x CP ranks hold the same shard: one writes it
    owner = stepping_replicas(optimizer, slots, owner)
    replica, tp_rank = groups.replica_rank, groups.tensor_parallel_rank

    def writer_of(index: int, slot: Slot) -> bool:
        # One data-parallel replica writes each tensor; a TP-replicated tensor is written by TP rank 0 only; a run
        # of experts by one of the ranks holding it (its expert-data-parallel group; TP rank 0 of those).
        if is_expert_parallel(slot.param):
            copies = groups.replica_size // groups.layout.expert_parallel
            return owner[index] % copies == groups.expert_place()[1] and slot.tp_writer
        return owner[index] == replica and slot.tp_writer

    snapshot = background is not None  # training goes on: the pieces must not alias live tensors
    pieces = collect_pieces(
        slots, optimizer, strategy.engine, writer_of, groups.replica_size, tp_rank, snapshot=snapshot
    )
    if replica == 0 and tp_rank == 0:  # buffers are whole on every rank of the stage: its first writes them
        pieces += buffer_pieces(module_buffers(module), snapshot=snapshot)
    header = None
    if strategy.is_global_zero:  # everything rank 0 publishes, taken now (the writer runs after later steps)
        layout = strategy.layout
        saved_by = {
            "tensor_parallel": layout.tensor_parallel,
            "pipeline_parallel": layout.pipeline_parallel,
            "data_parallel": layout.data_parallel,
            "context_parallel": layout.context_parallel,
            "expert_parallel": layout.expert_parallel,
            "zero_stage": strategy.zero_stage,
        }
        header = checkpoint_header(module, checkpoint, optimizer, saved_by)
    name = f"rank-{strategy.global_rank:05d}.safetensors"
    if background is None:
        write_and_publish(staging, path, name, pieces, header, group=None)
        strategy.barrier()
    else:
        background.submit(lambda: write_and_publish(staging, path, name, pieces, header, background.group))


def checkpoint_header(module, checkpoint: dict, optimizer, saved_by: dict) -> tuple[dict, dict, str | None]:
    """What the publishing rank writes besides its pieces: Lightning's non-tensor entries with the optimizer's
    hyper-parameters (meta), the manifest's info and the files it carries. A copy: the writer may run later."""
    meta = {k: v for k, v in checkpoint.items() if k not in LIGHTNING_TENSOR_KEYS}
    meta["optimizer"] = copy.deepcopy(optimizer_meta(optimizer)) if optimizer is not None else None
    return meta, checkpoint_info(module, module.trainer, saved_by), carried_files(module.trainer)


def write_and_publish(staging: Path, path: Path, name: str, pieces, header, group=None, alone: bool = False) -> None:
    """The one checkpoint writer: this rank's pieces into `staging/name`; the rank holding the `header` (from
    `checkpoint_header`) then writes the meta, the carried files (tokenizer, chat template) and the manifest of every
    rank's files, and publishes.
    `group`: the ranks writing this save (None: the world); `alone`: this process is the only writer (Lightning's
    one-process and DDP strategies save on rank 0 only)."""
    written = write_pieces(staging, name, pieces)
    files = [written] if alone else _all_gather(written, group)
    if header is not None:
        meta, info, carried = header
        files.append(write_meta(staging, meta))
        files += write_carried(staging, carried)
        write_manifest(staging, files, info)
        publish(staging, path)
    if group is not None:
        dist.barrier(group=group)  # every rank knows the save is published before the next one starts


def check_checkpoint(path: Path, slots: list[Slot], config, rank: int, world: int) -> tuple[dict, dict]:
    """Everything that can fail, before any state is touched, with the same one-line error on every rank:
    a folder that is not a complete checkpoint, a missing / truncated / altered file (each rank checks a share),
    a model of another shape (the first mismatching tensor by name)."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as error:
        manifest, problem = None, str(error)
    else:
        names = sorted(manifest["files"])
        problem = verify_files(path, manifest, names[rank::world])
        if problem is None:
            problem = _shape_mismatch(manifest, slots, config)
    problem = _first_error(_all_gather(problem))
    if problem:
        raise CheckpointError(problem)
    return manifest, read_meta(path, manifest)


def _shape_mismatch(manifest: dict, slots: list[Slot], config) -> str | None:
    problem = config_mismatch(manifest, config)
    if problem:
        return problem
    tensors = manifest["tensors"]
    for slot in slots:  # the boxes this layout needs exist in the stored shapes
        if f"model/{slot.name}" not in tensors:  # e.g. an adapter of other LoRA settings, or none
            return f"the checkpoint has no tensor {slot.name}, which this model trains (other LoRA settings?)"
        if tuple(tensors[f"model/{slot.name}"]["shape"]) != slot.global_shape:
            return f"tensor {slot.name} does not fit this layout's shards"
    return None


def load_sharded(strategy, path: Path) -> dict[str, Any]:
    module, groups = strategy.lightning_module, strategy.groups
    slots = model_slots(module.model, module.config, groups.tensor_parallel_rank, groups.tensor_parallel_size)
    manifest, meta = check_checkpoint(path, slots, module.config, strategy.global_rank, strategy.world_size)
    optimizer = strategy.optimizers[0] if strategy.optimizers else None
    optimizer_state = meta.get("optimizer") or {}
    if optimizer is not None and module.hparams.get("reset_optimizer"):  # a fresh optimizer and LR schedule
        optimizer, optimizer_state = None, {}
        meta["lr_schedulers"] = [config.scheduler.state_dict() for config in strategy.lr_scheduler_configs]
    elif optimizer is not None and optimizer_state:
        check_same_optimizer(optimizer_state, optimizer_name(optimizer))
    reader = TensorReader(path, manifest)
    restore_pieces(reader, slots, optimizer, strategy.engine, optimizer_state, groups)
    restore_buffers(reader, module_buffers(module))  # checked present: `config_mismatch` expects them
    if optimizer is not None and optimizer_state:
        restore_optimizer_meta(optimizer, optimizer_state)
    return meta
