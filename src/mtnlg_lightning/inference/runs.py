"""The one run of `mtnlg-eval` and `mtnlg-generate`, in any layout (one process is 1 x 1 x 1): check, plan, launch,
load, work, finish.

Everything that needs no weights is checked first, in the launching process (or on every rank under torchrun): the
command's own arguments, the strategy file, the model source (a checkpoint's manifest and its tensors' shapes
against its model config, a Hugging Face directory's config and tensor names), and the layout against the model
(heads, vocabulary, layers) and the world size. Only then are ranks started and slices read. Only rank 0 prints
results, writes files and reports errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtnlg_lightning.checkpoint.model_state import ModelState
from mtnlg_lightning.errors import MTNLGError, run_main
from mtnlg_lightning.inference.launch import (
    check_layout,
    finish,
    init_distributed,
    launch_local,
    needs_launch,
    read_strategy,
    world_size_for,
)
from mtnlg_lightning.inference.load import load, pick_device, pick_dtype
from mtnlg_lightning.interop.hf import read_source
from mtnlg_lightning.parallel.config import ParallelConfig
from mtnlg_lightning.parallel.layout import ParallelLayout, ProcessGroups
from mtnlg_lightning.quick_exit import skip_final_garbage_collection


@dataclass
class Plan:
    source: ModelState  # the architecture, tokenizer and (lazily read) weights
    strategy: ParallelConfig  # what the strategy file asks for: TP, PP and its schedule, SP, CP and its kernel
    layout: ParallelLayout  # the ranks' grid it makes with the world size (DP is what is left)
    world_size: int


def plan(checkpoint: str, strategy_file: str | None, devices: int | None) -> Plan:
    """The checks that read no weights; the run's layout."""
    strategy = read_strategy(strategy_file)
    world = world_size_for(devices)
    source = read_source(checkpoint, verify="opened")
    layout = check_layout(strategy, world, source.config)
    return Plan(source, strategy, layout, world)


def join(plan_: Plan, device_arg: str) -> tuple[ProcessGroups, torch.device]:
    """This rank's process groups and device: a world of one needs no process group at all."""
    if plan_.world_size == 1 and not dist.is_initialized():
        return ProcessGroups.single(), pick_device(device_arg)
    device = init_distributed(device_arg)
    if dist.get_world_size() != plan_.world_size:
        raise MTNLGError(f"the world has {dist.get_world_size()} ranks, the layout needs {plan_.world_size}")
    return ProcessGroups.create(plan_.layout, backend=dist.get_backend()), device


def load_planned(plan_: Plan, device_arg: str, dtype_arg: str, decoding: bool = False):
    """This rank's `ShardedModel` of the plan (joining the world first). `decoding`: without sequence parallelism
    (one decoded position cannot be cut over TP) and with the weights in the generation layout."""
    groups, device = join(plan_, device_arg)
    strategy = plan_.strategy
    sequence_parallel = strategy.sequence_parallel and not decoding
    dtype = pick_dtype(dtype_arg, device)
    return load(
        plan_.source,
        groups,
        device,
        dtype,
        strategy.pipeline,
        sequence_parallel,
        for_generation=decoding,
        context_parallel_kernel=strategy.context_parallel_kernel,
    )


Check = Callable[[object], "dict[str, str] | None"]  # the command's own checks; what its ranks inherit (env)
Work = Callable[[object, Plan], None]  # (the ShardedModel, the plan): score or decode, and report on rank 0
Prepare = Callable[[Plan], None]  # the command's checks that need the source but no weights (e.g. its tokenizer)


def run(
    prog: str,
    module: str,
    args,
    argv: list[str],
    check: Check,
    work: Work,
    decoding: bool = False,
    prepare: Prepare | None = None,
) -> int:
    """Check the arguments, plan, `prepare` (in the launching process too), start the ranks (`--devices N` in a
    plain process: `module` is run as each of them with `argv` and the environment `check` returned), load this
    rank's slices and `work`; the exit status (2 with one line for bad input)."""
    skip_final_garbage_collection()  # quick_exit.py: a quicker exit

    def body() -> int:
        env = check(args)
        plan_ = plan(args.checkpoint, args.strategy, args.devices)
        if decoding and plan_.strategy.context_parallel > 1:
            raise MTNLGError(
                "decoding adds one position at a time, which context parallelism cannot cut into chunks: generate "
                "with a strategy without context_parallel"
            )
        if prepare is not None:
            prepare(plan_)
        if needs_launch(plan_.world_size):
            return launch_local(module, argv, plan_.world_size, env)
        model = load_planned(plan_, args.device, args.dtype, decoding)
        work(model, plan_)
        return 0

    try:
        return run_main(prog, body)
    finally:
        finish()
