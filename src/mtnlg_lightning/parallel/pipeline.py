"""Pipeline parallelism: stage partitioning, per-stage models, the tied embedding across stages, schedules.

Schedules come from `torch.distributed.pipelining`; this file only decides what each stage holds.

A stage is the GPT itself with the parts it does not own deleted (torchtitan's approach): stage 0 keeps the
embedding, the last stage keeps the final norm and the LM head, every stage keeps its range of blocks under their
original names (so checkpoints and parameter names match the single-process model).

Tied embedding (Megatron: the LM head on the last stage is a copy of the word embedding, and the two gradients
are summed every step). Here the embedding parameter lives only on the first stage; at the start of every step
the last stage receives it into a gradient-tracking copy, and after the backward its gradient is sent back and
added to the embedding's gradient before the optimizer step. So the two are bit-identical by construction, the
optimizer and the grad norm see the weight once, and ZeRO (1 or 2) needs no special case for it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mtnlg_lightning.errors import MTNLGError

SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
}
# torch's ScheduleInterleavedZeroBubble is left out: with torch 2.13 its first-stage embedding gradient differed
# from the single-process one (1.2e-2) in our equivalence probe; ZBV zero-bubble matched exactly.
MULTI_STAGE = {"interleaved_1f1b", "looped_bfs", "zbv_zero_bubble"}
V_SHAPED = {"zbv_zero_bubble"}


def layers_per_stage(num_layers: int, num_stages: int, first_stage_layers: int | None = None,
                     last_stage_layers: int | None = None) -> list[int]:
    """Blocks per stage: balanced (extra blocks go to the middle/later stages, since the first and last stages
    also hold the embedding and the head), or with explicit counts for the first and/or last stage."""
    if num_stages < 1:
        raise MTNLGError(f"pipeline stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise MTNLGError(f"{num_stages} pipeline stages is more than the model's {num_layers} layers")
    if num_stages == 1:
        return [num_layers]
    fixed = {0: first_stage_layers, num_stages - 1: last_stage_layers}
    fixed = {i: n for i, n in fixed.items() if n is not None}
    rest_stages = num_stages - len(fixed)
    rest_layers = num_layers - sum(fixed.values())
    if any(n < 1 for n in fixed.values()) or rest_layers < rest_stages or (rest_stages == 0 and rest_layers):
        raise MTNLGError(f"first/last stage layers {first_stage_layers}/{last_stage_layers} leave {rest_layers} "
                         f"layers for {rest_stages} other stages of {num_layers} layers on {num_stages} stages")
    base, extra = divmod(rest_layers, rest_stages) if rest_stages else (0, 0)
    free = [i for i in range(num_stages) if i not in fixed]
    # Extra blocks go to the middle stages first (the first and last also hold the embedding and the LM head).
    ends = (0, num_stages - 1)
    preference = [i for i in reversed(free) if i not in ends] + [i for i in free if i in ends]
    bonus = set(preference[:extra])
    counts = [fixed.get(i, base + (1 if i in bonus else 0)) for i in range(num_stages)]
    assert sum(counts) == num_layers, counts
    return counts


def stage_ranks(schedule: str, pp_size: int, stages_per_rank: int) -> list[list[int]]:
    """Stage indices held by each pipeline rank: looped (r, r+PP, ...) or V-shaped (r, 2PP-1-r)."""
    if schedule in V_SHAPED:
        if stages_per_rank != 2:
            raise MTNLGError(f"schedule {schedule} needs exactly 2 stages per rank, got {stages_per_rank}")
        return [[r, 2 * pp_size - 1 - r] for r in range(pp_size)]
    return [[r + v * pp_size for v in range(stages_per_rank)] for r in range(pp_size)]


def build_stage(model: nn.Module, stage_index: int, layer_counts: list[int]) -> nn.Module:
    """Prune `model` (in place) to the blocks of `stage_index`, keeping embed on stage 0 and norm/head on the last.

    The last stage (when it is not also the first) keeps `lm_head` with its weight turned into a plain tensor
    slot that `TiedEmbedding` fills every step."""
    num_stages = len(layer_counts)
    first = sum(layer_counts[:stage_index])
    owned = {str(i) for i in range(first, first + layer_counts[stage_index])}
    for name in list(model.blocks.keys()):
        if name not in owned:
            del model.blocks[name]
    is_first, is_last = stage_index == 0, stage_index == num_stages - 1
    if is_last and not is_first:
        weight = model.lm_head.weight
        del model.lm_head.weight  # no longer a parameter: a per-step copy of the first stage's embedding
        model.lm_head.weight = weight.detach().clone().requires_grad_(True)
    if not is_first:
        model.embed = None
    if not is_last:
        model.norm = None
        model.lm_head = None
    return model


def retie_on_same_rank(stage_models: list[nn.Module]) -> bool:
    """When one rank holds both the first and the last stage (V-shaped schedules), the head shares the embedding
    parameter again, as in the single-process model. Returns whether it did."""
    firsts = [m for m in stage_models if m.embed is not None]
    lasts = [m for m in stage_models if m.lm_head is not None]
    if not (firsts and lasts) or firsts[0] is lasts[0]:
        return False
    del lasts[0].lm_head.weight
    lasts[0].lm_head.weight = firsts[0].embed.wte.weight
    return True


class TiedEmbedding:
    """Keeps the last stage's LM-head weight equal to stage 0's word embedding and returns its gradient.

    `embedding_group` holds the two ranks (same dp and tp coordinates) that own stage 0 and the last stage."""

    def __init__(self, group, first_rank: int, last_rank: int, weight: torch.Tensor, is_first: bool):
        self.group, self.first_rank, self.last_rank = group, first_rank, last_rank
        self.weight, self.is_first = weight, is_first

    def broadcast_weight(self) -> None:
        """Start of step: the head copy receives the current embedding."""
        with torch.no_grad():
            buffer = self.weight.data if self.is_first else self.weight.detach()
            dist.broadcast(buffer, src=self.first_rank, group=self.group)
        if not self.is_first:
            self.weight.grad = None

    def reduce_grad(self, add_to_embedding_grad) -> None:
        """After the backward: the head's gradient is sent to stage 0 and added by `add_to_embedding_grad(grad)`."""
        if self.is_first:
            grad = torch.empty_like(self.weight)
            dist.broadcast(grad, src=self.last_rank, group=self.group)
            add_to_embedding_grad(grad)
        else:
            grad = self.weight.grad if self.weight.grad is not None else torch.zeros_like(self.weight)
            dist.broadcast(grad.contiguous(), src=self.last_rank, group=self.group)


def schedule_class(name: str):
    import torch.distributed.pipelining as pipelining

    if name not in SCHEDULES:
        raise MTNLGError(f"unknown pipeline schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    return getattr(pipelining, SCHEDULES[name])
