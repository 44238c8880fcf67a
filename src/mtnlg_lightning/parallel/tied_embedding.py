"""The word embedding and the LM head as one weight when pipeline parallelism puts them on different ranks (and
the embedding the multi-token prediction depths of the last stage use, tied head or not: `mtp.py`).

Megatron ties the LM head on the last stage to the word embedding on the first and sums the two gradients every
step. Here the parameter lives only on the first stage (sharded along the vocabulary over TP like the embedding);
the last stage holds a gradient-tracking copy. After every update (and checkpoint load) the copy receives the
embedding; after each backward the copy's gradient is sent back and added to the embedding's. So the two are
bit-identical by construction, the optimizer and the grad norm see the weight once, and ZeRO needs no special case
for it. The step calls the three hooks (`after_backward`, `after_update`, `after_load`); nothing else touches it.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

from mtnlg_lightning.parallel.deepspeed_compat import engine_backward
from mtnlg_lightning.parallel.layout import ParallelLayout, ProcessGroups
from mtnlg_lightning.parallel.pipeline import stages_held_by_rank
from mtnlg_lightning.parallel.zero import takes_gradients_in_hooks


class TiedEmbedding:
    """This rank's end of the tie: the first stage's embedding shard or the last stage's head copy of it.

    `group` holds the two ranks with this rank's (dp, tp) coordinates that own the first and the last stage."""

    def __init__(self, group, first_rank: int, last_rank: int, weight: torch.Tensor, is_first: bool):
        self.group, self.first_rank, self.last_rank = group, first_rank, last_rank
        self.weight, self.is_first = weight, is_first
        self.engine = None  # the ZeRO engine that owns the embedding's gradient, once there is one

    @classmethod
    def link(
        cls, stage_models: list[nn.Module], groups: ProcessGroups, schedule: str, virtual_stages: int
    ) -> TiedEmbedding | None:
        """Collectively create the tie of every (dp, tp) coordinate; this rank's end, or None when it holds neither
        end or both (V-shaped schedules keep the single-process parameter sharing). Call after TP sharding: the
        tensors are the final ones."""
        config = stage_models[0].config
        # an untied head is a parameter of the last stage alone; multi-token prediction depths (on the last stage)
        # embed tokens with a copy of the embedding all the same (`pipeline.build_stage`)
        if not config.tie_embeddings and not config.mtp_layers:
            return None
        group, first_rank, last_rank = _embedding_group(groups.layout, schedule, virtual_stages, groups.rank)
        if group is None:
            return None
        firsts = [m for m in stage_models if m.embed is not None]
        lasts = [m for m in stage_models if m.lm_head is not None]
        if firsts:
            weight = firsts[0].embed.wte.weight
        else:  # the tied head's copy, which the depths share, or the depths' own
            weight = lasts[0].lm_head.weight if config.tie_embeddings else lasts[0].mtp.embed.wte.weight
        return cls(group, first_rank, last_rank, weight, is_first=bool(firsts))

    def use_engine(self, engine) -> None:
        """Under ZeRO: the head copy takes the dtype the engine gave the stage's parameters (bf16 under DeepSpeed
        bf16; it is a plain tensor, which the engine's conversion skips, and both ends of the broadcast need one
        dtype), and the embedding's gradient is added where the engine expects it."""
        self.engine = engine
        dtype = next(iter(engine.module.parameters())).dtype
        if not self.is_first and self.weight.dtype != dtype:
            self.weight.data = self.weight.data.to(dtype)

    # ------------------------------------------------------------------ the step's hooks
    def after_backward(self) -> None:
        """The head's gradient is sent to the first stage and added to the embedding's (before the DP reduction
        and clipping). Sent in fp32 whatever the weights' dtype: both ends agree on it without asking (under bf16
        the head's gradient may be bf16 or fp32 depending on the optimizer), and the sum is kept in the masters'
        precision."""
        if self.is_first:
            grad = torch.empty_like(self.weight, dtype=torch.float32)
            dist.broadcast(grad, src=self.last_rank, group=self.group)
            self._add_to_embedding_grad(grad)
        else:
            grad = self.weight.grad if self.weight.grad is not None else torch.zeros_like(self.weight)
            dist.broadcast(grad.float().contiguous(), src=self.last_rank, group=self.group)

    def after_update(self) -> None:
        """The head copy receives the updated (or, after a vetoed update, unchanged) embedding."""
        with torch.no_grad():
            buffer = self.weight.data if self.is_first else self.weight.detach()
            dist.broadcast(buffer, src=self.first_rank, group=self.group)
        if not self.is_first:
            self.weight.grad = None

    def after_load(self) -> None:
        """A checkpoint holds the embedding once: the head copy receives the loaded one."""
        self.after_update()

    def _add_to_embedding_grad(self, grad: torch.Tensor) -> None:
        if self.engine is not None and takes_gradients_in_hooks(self.engine):  # ZeRO-2, bf16 ZeRO-1
            with engine_backward(self.engine):  # the engine's hooks move it out of .grad: go through autograd
                torch.autograd.backward((self.weight * grad).sum())
        elif self.weight.grad is None:
            self.weight.grad = grad.clone()
        else:
            self.weight.grad.add_(grad)


def _embedding_group(layout: ParallelLayout, schedule: str, virtual_stages: int, rank: int):
    """Collectively create the {first stage, last stage} groups (one per (dp, cp, tp)); return this rank's and the two
    ranks, or (None, None, None) when one rank holds both ends (V-shaped schedules) or there is no pipeline."""
    pp = layout.pipeline_parallel
    placement = stages_held_by_rank(schedule, pp, virtual_stages)
    last_stage = pp * virtual_stages - 1
    first_pp = next(r for r, stages in enumerate(placement) if 0 in stages)
    last_pp = next(r for r, stages in enumerate(placement) if last_stage in stages)
    if pp == 1 or first_pp == last_pp:
        return None, None, None
    mine = (None, None, None)
    for d, c, t in itertools.product(
        range(layout.data_parallel), range(layout.context_parallel), range(layout.tensor_parallel)
    ):
        ends = [layout.rank(first_pp, d, t, c), layout.rank(last_pp, d, t, c)]
        group = dist.new_group(ends)  # every rank takes part in creating every group
        if rank in ends:
            mine = (group, ends[0], ends[1])
    return mine
