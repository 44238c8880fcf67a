"""Every parameter at full size on every rank, whatever the layout: for the equivalence tests only (evaluation during
training scores in the layout, `inference.scoring`; gathering 530B onto every rank would need 1 TB each)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from mtnlg_lightning.parallel.expert_parallel import is_expert_parallel
from mtnlg_lightning.parallel.pipeline import PipelineChunks
from mtnlg_lightning.parallel.tensor_parallel import gather_tensor_parallel


@torch.no_grad()
def full_state_dict(strategy, master: bool = False) -> dict[str, torch.Tensor]:
    """Single-process parameter names -> full tensors (ZeRO-3 partitions and TP shards gathered, every pipeline
    stage's parameters), on every rank of a `MegatronDeepSpeedStrategy`. Collective: every rank must call it.
    `master`: DeepSpeed's fp32 master weights where the engine keeps bf16/fp16 weights (the values it updates)."""
    model = strategy.lightning_module.model
    params = dict(model.named_parameters())
    context = nullcontext()
    if strategy.engine is not None and strategy.zero_stage == 3:
        import deepspeed

        context = deepspeed.zero.GatheredParameters(list(params.values()))
    groups = strategy.groups
    out = {}
    with context:
        for name, p in params.items():
            value = _master(p) if master and strategy.engine is not None and p.dtype != torch.float32 else p.detach()
            value = value.clone()
            if hasattr(p, "partition_dim") and groups.tensor_parallel_size > 1:
                value = gather_shards(value, p, groups)
            if is_expert_parallel(p):  # the runs of experts of the EP group, in expert order
                value = gather_tensor_parallel(value, 0, groups.expert_parallel_group)
            if isinstance(model, PipelineChunks):
                name = name.split(".", 1)[1]  # "<chunk>.blocks.7.x" -> "blocks.7.x" (block names are global)
            out[name] = value
    if strategy.pipeline_parallel > 1:  # every stage's parameters, on every rank
        parts = [None] * strategy.pipeline_parallel
        dist.all_gather_object(parts, {k: v.cpu() for k, v in out.items()}, group=groups.pipeline_parallel_group)
        out = {k: v.to(strategy.root_device) for part in parts for k, v in part.items()}
    return out


def gather_shards(value: torch.Tensor, param, groups) -> torch.Tensor:
    """The whole tensor of a TP-sharded parameter; shards held by several ranks (replicated key/value heads) once."""
    gathered = gather_tensor_parallel(value, param.partition_dim, groups.tensor_parallel_group)
    copies = groups.tensor_parallel_size // param.partition_count
    if copies == 1:
        return gathered
    return torch.cat(
        gathered.chunk(groups.tensor_parallel_size, dim=param.partition_dim)[::copies], param.partition_dim
    )


def _master(param: torch.Tensor) -> torch.Tensor:
    """This rank's (TP-local) parameter in fp32 from DeepSpeed's master partitions (collective over data-parallel)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(param)
