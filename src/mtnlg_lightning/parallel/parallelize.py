"""Apply the layout to a single-process GPT in one step: pipeline split, tensor-parallel sharding, tied embedding.

As torchtitan's `parallelize_llama`, parallelism is applied from outside to a plain model; the strategy calls
`parallelize_gpt` once and wires the result into Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtnlg_lightning.parallel.layout import ProcessGroups
from mtnlg_lightning.parallel.pipeline import (
    PipelineChunks,
    PipelineRunner,
    TiedEmbedding,
    create_embedding_group,
    split_into_stages,
    stages_held_by_rank,
)
from mtnlg_lightning.parallel.tensor_parallel import VocabParallelCrossEntropy, apply_tensor_parallel


@dataclass(frozen=True)
class PipelineParallelSettings:
    """How the model is cut into pipeline stages and scheduled."""

    schedule: str = "1f1b"
    virtual_stages: int = 1  # stages per pipeline rank (interleaved and V-shaped schedules hold several)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None


@dataclass
class ParallelGPT:
    """This rank's part of the model and how to run it."""

    model: nn.Module  # the TP-sharded model, this rank's stage, or `PipelineChunks` of its virtual stages
    loss_fn: object | None  # the vocab-parallel cross-entropy under TP (None: keep the module's own)
    pipeline: PipelineRunner | None  # the schedule runner when pipelined


def parallelize_gpt(
    model: nn.Module,
    groups: ProcessGroups,
    device: torch.device,
    pipeline: PipelineParallelSettings,
    sequence_parallel: bool = False,
) -> ParallelGPT:
    """Split `model` into this rank's pipeline stage(s), shard them over the TP group (with Megatron's sequence
    parallelism when asked: a stage boundary then carries the sequence shard) and link the tied embedding across
    the first and last stages. `model` must hold full (unsharded) weights; it is modified in place."""
    layout = groups.layout
    runner = None
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
            layout.rank(last_pp, groups.coord.dp, groups.coord.tp),
            is_first=any(m.embed is not None for m in stage_models),
            is_last=any(m.lm_head is not None for m in stage_models),
        )
    for stage_model in stage_models:
        apply_tensor_parallel(
            stage_model,
            groups.tensor_parallel_group,
            groups.tensor_parallel_rank,
            groups.tensor_parallel_size,
            sequence_parallel=sequence_parallel,
        )
    if runner is not None:
        runner.tied = _tied_embedding(stage_models, groups, pipeline)  # after TP sharding: the final tensors
    loss_fn = VocabParallelCrossEntropy(groups.tensor_parallel_group) if groups.tensor_parallel_size > 1 else None
    if len(stage_models) > 1:
        model = PipelineChunks(stage_models)
    else:
        model = stage_models[0]
    return ParallelGPT(model, loss_fn, runner)


def _tied_embedding(stage_models, groups: ProcessGroups, pipeline: PipelineParallelSettings) -> TiedEmbedding | None:
    """The link between the word embedding (first stage) and the LM-head copy (last stage) of this rank's
    (dp, tp) coordinates; None when this rank holds neither end or both (V-shaped schedules)."""
    group, first_rank, last_rank = create_embedding_group(
        groups.layout, pipeline.schedule, pipeline.virtual_stages, groups.rank
    )
    if group is None:
        return None
    firsts = [m for m in stage_models if m.embed is not None]
    lasts = [m for m in stage_models if m.lm_head is not None]
    weight = firsts[0].embed.wte.weight if firsts else lasts[0].lm_head.weight
    return TiedEmbedding(group, first_rank, last_rank, weight, is_first=bool(firsts))
