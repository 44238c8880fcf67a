"""Apply the layout to a single-process GPT in one step: pipeline split, tensor-parallel sharding, tied embedding.

As torchtitan's `parallelize_llama`, parallelism is applied from outside to a plain model; the strategy calls
`parallelize_gpt` once and wires the result into Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtnlg_lightning.model import cross_entropy
from mtnlg_lightning.parallel.config import PipelineParallelSettings
from mtnlg_lightning.parallel.context_parallel import ContextParallelLoss, Ring, apply_context_parallel
from mtnlg_lightning.parallel.layout import ProcessGroups, kv_head_copies
from mtnlg_lightning.parallel.pipeline import PipelineChunks, PipelineRunner, split_into_stages, stages_held_by_rank
from mtnlg_lightning.parallel.tensor_parallel import VocabParallelCrossEntropy, apply_tensor_parallel
from mtnlg_lightning.parallel.tied_embedding import TiedEmbedding


@dataclass
class ParallelGPT:
    """This rank's part of the model and how to run it."""

    model: nn.Module  # the TP-sharded model, this rank's stage, or `PipelineChunks` of its virtual stages
    loss_fn: object | None  # the vocab-parallel (TP) and/or chunked (CP) cross-entropy; None: the module's own
    pipeline: PipelineRunner | None  # the schedule runner when pipelined
    tied_embedding: TiedEmbedding | None  # this rank's end of the embedding / LM-head tie across stages


def parallelize_gpt(
    model: nn.Module,
    groups: ProcessGroups,
    device: torch.device,
    pipeline: PipelineParallelSettings,
    sequence_parallel: bool = False,
    context_parallel_kernel: str = "auto",
) -> ParallelGPT:
    """Split `model` into this rank's pipeline stage(s), shard them over the TP group (with Megatron's sequence
    parallelism when asked: a stage boundary then carries the sequence shard) and link the tied embedding across
    the first and last stages. `model` must hold full (unsharded) weights; it is modified in place."""
    layout = groups.layout
    runner, tied = None, None
    stage_models = [model]
    if layout.pipeline_parallel > 1:
        stage_models, indices, _ = split_into_stages(
            model,
            layout.pipeline_parallel,
            groups.pipeline_parallel_rank,
            pipeline.schedule,
            pipeline.virtual_stages,
            pipeline.first_stage_layers,
            pipeline.last_stage_layers,
        )
        num_stages = layout.pipeline_parallel * pipeline.virtual_stages
        placement = stages_held_by_rank(pipeline.schedule, layout.pipeline_parallel, pipeline.virtual_stages)
        last_pp = next(r for r, stages in enumerate(placement) if num_stages - 1 in stages)
        runner = PipelineRunner(
            stage_models,
            indices,
            num_stages,
            pipeline.schedule,
            device,
            groups.pipeline_parallel_group,
            layout.rank(last_pp, groups.coord.dp, groups.coord.tp, groups.coord.cp),
            is_first=any(m.embed is not None for m in stage_models),
            is_last=any(m.lm_head is not None for m in stage_models),
        )
    config = model.config
    copies = 1 if config.fused_qkv else kv_head_copies(config.num_kv_heads, groups.tensor_parallel_size)
    kv_group = groups.kv_head_group(copies) if copies > 1 else None  # collective: every rank makes every group
    for stage_model in stage_models:
        apply_tensor_parallel(
            stage_model,
            groups.tensor_parallel_group,
            groups.tensor_parallel_rank,
            groups.tensor_parallel_size,
            sequence_parallel=sequence_parallel,
            kv_group=kv_group,
        )
    if layout.context_parallel > 1:
        ring = Ring(groups.context_parallel_group, groups.ranks["cp"], groups.context_parallel_rank)
        for stage_model in stage_models:
            apply_context_parallel(stage_model, ring, context_parallel_kernel)
    if runner is not None:  # after TP sharding: the tie links the final (vocabulary-sharded) tensors
        tied = TiedEmbedding.link(stage_models, groups, pipeline.schedule, pipeline.virtual_stages)
    loss_fn = VocabParallelCrossEntropy(groups.tensor_parallel_group) if groups.tensor_parallel_size > 1 else None
    if layout.context_parallel > 1:  # the loss of this rank's chunks of the targets
        loss_fn = ContextParallelLoss(loss_fn or cross_entropy, groups.context_parallel_rank, layout.context_parallel)
    if len(stage_models) > 1:
        model = PipelineChunks(stage_models)
    else:
        model = stage_models[0]
    return ParallelGPT(model, loss_fn, runner, tied)
