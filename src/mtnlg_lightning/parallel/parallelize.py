"""Every transform of a built, single-process GPT, in one function and one fixed order (`parallelize_gpt`).

As torchtitan's `parallelize_llama`, parallelism is applied from outside to a plain model. The order, each step
working on what the one before made:
  0. model converters: LoRA adapters (`lora.py`) on the full model, its base frozen;
  1. pipeline split: this rank's stages (blocks under their global names; embedding first, head last);
  2. tensor parallelism, with sequence parallelism: Linear/Embedding layers swapped for sharded ones;
  3. expert parallelism: this rank's run of each MoE layer's experts, rows routed to the others by all-to-all;
     context parallelism: ring attention cores, this rank's chunks of the sequence;
  4. activation checkpointing: of the blocks or attention cores as they now are (a ring core included);
  5. compilation: each block, lazily, so what wraps or shards it is traced at its first call;
  6. the tied embedding linked across the first and last stages (after the sharding: it links the final tensors);
  7. in training, the LM head applied by the loss (`output_layer.py`: logits where labels count, in chunks);
then the ZeRO hand-off, which needs the optimizer: the strategy gives model and optimizer to DeepSpeed in its
`setup`. The 3D strategy calls this in its `setup`; under Lightning's
own strategies (one device, DDP) the module calls it without process groups (steps 0, 4 and 5 only).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.model import compile_blocks
from mtnlg_lightning.parallel.activation_checkpointing import NO_RECOMPUTE, Recompute
from mtnlg_lightning.parallel.config import PipelineParallelSettings
from mtnlg_lightning.parallel.context_parallel import ContextParallelLoss, Ring, apply_context_parallel
from mtnlg_lightning.parallel.expert_parallel import apply_expert_parallel
from mtnlg_lightning.parallel.layout import ParallelLayout, ProcessGroups, kv_head_copies
from mtnlg_lightning.parallel.lora import LoRAConfig, apply_lora, shard_with_adapters
from mtnlg_lightning.parallel.output_layer import OutputLoss
from mtnlg_lightning.parallel.pipeline import PipelineChunks, PipelineRunner, split_into_stages, stages_held_by_rank
from mtnlg_lightning.parallel.tensor_parallel import apply_tensor_parallel
from mtnlg_lightning.parallel.tied_embedding import TiedEmbedding

ONE_STAGE = PipelineParallelSettings()


@dataclass
class ParallelGPT:
    """This rank's part of the model and how to run it."""

    model: nn.Module  # the TP-sharded model, this rank's stage, or `PipelineChunks` of its virtual stages
    loss_fn: object | None  # training's token loss with the head in it (`OutputLoss`; CP: of this rank's chunks)
    pipeline: PipelineRunner | None  # the schedule runner when pipelined
    tied_embedding: TiedEmbedding | None  # this rank's end of the embedding / LM-head tie across stages


def parallelize_gpt(
    model: nn.Module,
    groups: ProcessGroups | None,
    device: torch.device,
    pipeline: PipelineParallelSettings = ONE_STAGE,
    sequence_parallel: bool = False,
    context_parallel_kernel: str = "auto",
    recompute: Recompute = NO_RECOMPUTE,
    compile_backend: str | None = None,
    lora: LoRAConfig | None = None,
    head_in_loss: bool = False,
    loss_chunk_tokens: int | None = None,
) -> ParallelGPT:
    """This rank's part of `model` with every transform applied in the module docstring's order. `groups` None:
    one process, no model parallelism. `model` must hold full (unsharded) weights; it is modified in place.
    head_in_loss (training): `loss_fn` applies the LM head, in chunks of `loss_chunk_tokens`, to the final hidden
    states the model returns inside `output_layer.heads_in_loss` (`output_layer.OutputLoss`)."""
    layout = groups.layout if groups is not None else ParallelLayout(1)
    _check_multi_token_prediction(model.config, layout)
    if lora is not None:
        apply_lora(model, lora)
    runner = None
    stage_models = [model]
    if layout.pipeline_parallel > 1:
        stage_models, runner = _split_pipeline(model, groups, device, pipeline)
    if layout.tensor_parallel > 1:
        config = model.config
        copies = 1 if config.fused_qkv else kv_head_copies(config.num_kv_heads, groups.tensor_parallel_size)
        kv_group = groups.kv_head_group(copies) if copies > 1 else None  # collective: every rank makes every group
        rank, size = groups.tensor_parallel_rank, groups.tensor_parallel_size
        for stage_model in stage_models:
            shard = partial(
                apply_tensor_parallel,
                stage_model,
                groups.tensor_parallel_group,
                rank,
                size,
                sequence_parallel=sequence_parallel,
                kv_group=kv_group,
            )
            shard_with_adapters(stage_model, shard, rank, size, kv_group)
    if layout.expert_parallel > 1:
        for stage_model in stage_models:
            apply_expert_parallel(stage_model, groups)
    if layout.context_parallel > 1:
        ring = Ring(groups.context_parallel_group, groups.ranks["cp"], groups.context_parallel_rank)
        for stage_model in stage_models:
            apply_context_parallel(stage_model, ring, context_parallel_kernel)
    for stage_model in stage_models:
        recompute.apply(stage_model)
        if compile_backend is not None:
            compile_blocks(stage_model, compile_backend)
    tied = None
    # Under LoRA the embedding is frozen: the last stage's copy made at the split stays equal to it, nothing to link.
    if runner is not None and lora is None:
        tied = TiedEmbedding.link(stage_models, groups, pipeline.schedule, pipeline.virtual_stages)
    loss_fn = None
    if head_in_loss:  # training: the head runs inside the loss (`output_layer`) while the runner steps
        last = next((m for m in stage_models if m.lm_head is not None), stage_models[-1])
        tp_group = groups.tensor_parallel_group if layout.tensor_parallel > 1 else None
        vocab_local = model.config.padded_vocab_size() // layout.tensor_parallel
        loss_fn = OutputLoss(last, vocab_local, tp_group, loss_chunk_tokens)
        if layout.context_parallel > 1:  # the loss of this rank's chunks of the targets
            cp_rank, cp_group = groups.context_parallel_rank, groups.context_parallel_group
            loss_fn = ContextParallelLoss(loss_fn, cp_rank, layout.context_parallel, cp_group)
    model = PipelineChunks(stage_models) if len(stage_models) > 1 else stage_models[0]
    return ParallelGPT(model, loss_fn, runner, tied)


def _check_multi_token_prediction(config, layout: ParallelLayout) -> None:
    """Multi-token prediction (`mtp.py`) rolls whole rows of tokens and hidden states on the rank that holds the
    embedding and the head (a last pipeline stage holds a copy of the embedding; under sequence parallelism each
    rank's slice of them; under context parallelism the tokens k ahead of its chunks are read from the whole rows,
    which leaves a position table out)."""
    if not config.mtp_layers:
        return
    if layout.context_parallel > 1 and config.position_embedding != "rope":
        raise MTNLGError(
            "multi-token prediction (model.mtp_layers) under context parallelism needs rotary positions (no table)"
        )


def _split_pipeline(model: nn.Module, groups: ProcessGroups, device, pipeline: PipelineParallelSettings):
    """This rank's stage models and the runner of their schedule."""
    layout = groups.layout
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
    return stage_models, runner
