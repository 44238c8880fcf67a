"""Pipeline parallelism: stage partitioning, per-stage models, schedules.

Schedules come from `torch.distributed.pipelining`; this file only decides what each stage holds.

A stage is the GPT itself with the parts it does not own deleted (torchtitan's approach): stage 0 keeps the
embedding, the last stage keeps the final norm and the LM head, every stage keeps its range of blocks under their
original names (so checkpoints and parameter names match the single-process model).

The tied embedding across the first and last stages is `tied_embedding.TiedEmbedding`; this file only prunes the
last stage's LM head into the slot it fills.

Every stage receives the batch's `position_ids` and `document_ids` (packed rows) as keyword inputs of its forward:
each rank passes them to the schedule's step, which cuts them into micro-batches like the tokens and hands a
stage the micro-batch's with its activations (`torch.distributed.pipelining` passes step keyword arguments to
every stage), so the later stages rotate and mask as the first does.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.model import MODEL_INPUTS
from mtnlg_lightning.moe import RouterTotals
from mtnlg_lightning.torch_compat import pipeline_stage_class

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


def layers_per_stage(
    num_layers: int, num_stages: int, first_stage_layers: int | None = None, last_stage_layers: int | None = None
) -> list[int]:
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
        raise MTNLGError(
            f"first/last stage layers {first_stage_layers}/{last_stage_layers} leave {rest_layers} "
            f"layers for {rest_stages} other stages of {num_layers} layers on {num_stages} stages"
        )
    base, extra = divmod(rest_layers, rest_stages) if rest_stages else (0, 0)
    free = [i for i in range(num_stages) if i not in fixed]
    # Extra blocks go to the middle stages first (the first and last also hold the embedding and the LM head).
    ends = (0, num_stages - 1)
    preference = [i for i in reversed(free) if i not in ends] + [i for i in free if i in ends]
    bonus = set(preference[:extra])
    counts = [fixed.get(i, base + (1 if i in bonus else 0)) for i in range(num_stages)]
    assert sum(counts) == num_layers, counts
    return counts


def stages_held_by_rank(schedule: str, pp_size: int, virtual_stages: int) -> list[list[int]]:
    """Stage indices held by each pipeline rank: looped (r, r+PP, ...) or V-shaped (r, 2PP-1-r)."""
    if schedule in V_SHAPED:
        if virtual_stages != 2:
            raise MTNLGError(f"schedule {schedule} needs exactly 2 stages per rank, got {virtual_stages}")
        return [[r, 2 * pp_size - 1 - r] for r in range(pp_size)]
    return [[r + v * pp_size for v in range(virtual_stages)] for r in range(pp_size)]


def build_stage(model: nn.Module, stage_index: int, layer_counts: list[int]) -> nn.Module:
    """Prune `model` (in place) to the blocks of `stage_index`, keeping embed on stage 0 and norm/head on the last.

    The last stage (when it is not also the first) keeps `lm_head`: untied, with its own weight; tied, with its
    weight turned into a plain tensor slot that `tied_embedding.TiedEmbedding` fills every step."""
    num_stages = len(layer_counts)
    first = sum(layer_counts[:stage_index])
    owned = {str(i) for i in range(first, first + layer_counts[stage_index])}
    for name in list(model.blocks.keys()):
        if name not in owned:
            del model.blocks[name]
    is_first, is_last = stage_index == 0, stage_index == num_stages - 1
    if is_last and not is_first and model.config.tie_embeddings:
        weight = model.lm_head.weight
        del model.lm_head.weight  # no longer a parameter: a per-step copy of the first stage's embedding
        model.lm_head.weight = weight.detach().clone().requires_grad_(True)
    if model.mtp is not None and not is_last:
        model.mtp = None  # the multi-token prediction depths run on the last stage, after the final norm
    elif model.mtp is not None and not is_first:
        model.mtp.embed = _embedding_copy(model)
    if not is_first:
        model.embed = None
        model.register_forward_pre_hook(_send_back_contiguous_gradients)
    if not is_last:
        model.norm = None
        model.lm_head = None
    return model


def _embedding_copy(model: nn.Module) -> nn.Module:
    """The last stage's embedding for its multi-token prediction depths: the model's embedding module whose word
    embedding is a plain tensor, the per-step copy of the first stage's that `tied_embedding.TiedEmbedding` keeps
    (with a tied head, the head's copy itself: one copy for both). Positions enter through RoPE, not a table."""
    if model.config.position_embedding != "rope":
        raise MTNLGError("multi-token prediction under pipeline parallelism needs rotary positions (no table)")
    embed = copy.deepcopy(model.embed)
    del embed.wte.weight
    if model.config.tie_embeddings:
        embed.wte.weight = model.lm_head.weight
    else:
        embed.wte.weight = model.embed.wte.weight.detach().clone().requires_grad_(True)
    return embed


class _ContiguousGradient(torch.autograd.Function):
    """Identity forward; the gradient made contiguous backward. torch's stages receive a gradient into a buffer
    laid out as the sender's tensor was, and gloo receives into contiguous buffers only; some blocks' input
    gradients come out strided (a sequence-parallel reduce-scatter's view, through RMSNorm's backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _send_back_contiguous_gradients(module, args):
    """A forward pre-hook of every stage but the first: its input's gradient goes back to the previous stage."""
    return (_ContiguousGradient.apply(args[0]), *args[1:])


def carry_router_totals(stage_model: nn.Module, totals: RouterTotals) -> None:
    """A mixture-of-experts model's stage passes the router statistics on with its activations: it takes the
    totals of the stages before it as a second input (the first stage starts from zeros), adds its own layers'
    (`RouterTotals.add`), and outputs (activations, totals). The last stage's loss then sees every layer's
    routing of the micro-batch, as one process does (the auxiliary loss couples all layers: E x sum_e f_e P_e over
    every layer's rows), and the loss's gradient reaches each stage's routers back through the totals. Under 1F1B
    no stage waits for it: a micro-batch's forward has passed every stage before its backward starts."""

    def take_totals(module, args):
        if not module.carries_router_totals:
            return None
        if module.embed is not None:  # the first stage: (tokens,)
            module.carried_router_totals = None
            return None
        hidden, carried, *rest = args
        module.carried_router_totals = carried
        return (hidden, *rest)

    def give_totals(module, args, output):
        if not module.carries_router_totals:
            return None
        carried = module.carried_router_totals
        module.carried_router_totals = None
        return output, totals.add(totals.zeros(output.device) if carried is None else carried, module)

    stage_model.carries_router_totals = True  # inference passes activations only (`ShardedModel.forward`)
    stage_model.register_forward_pre_hook(take_totals)
    stage_model.register_forward_hook(give_totals)


def retie_on_same_rank(stage_models: list[nn.Module]) -> bool:
    """When one rank holds both the first and the last stage (V-shaped schedules), the head shares the embedding
    parameter again, as in the single-process model. Returns whether it did."""
    firsts = [m for m in stage_models if m.embed is not None]
    lasts = [m for m in stage_models if m.lm_head is not None]
    if not (firsts and lasts) or firsts[0] is lasts[0]:
        return False
    if lasts[0].mtp is not None:  # the multi-token prediction depths embed with the embedding itself again
        lasts[0].mtp.embed = firsts[0].embed
    if not firsts[0].config.tie_embeddings:
        return False
    del lasts[0].lm_head.weight
    lasts[0].lm_head.weight = firsts[0].embed.wte.weight
    return True


def schedule_class(name: str):
    # torch.distributed.pipelining takes ~2 s to import: only a pipeline-parallel run pays it
    import torch.distributed.pipelining as pipelining

    if name not in SCHEDULES:
        raise MTNLGError(f"unknown pipeline schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    return getattr(pipelining, SCHEDULES[name])


class PipelineChunks(nn.ModuleList):
    """The stage models one rank holds with virtual stages (interleaved schedules), as one module for the
    optimizer, DeepSpeed and checkpoints. Block names are global indices, so names stay unique across chunks."""


def split_into_stages(
    model: nn.Module,
    pp_size: int,
    pp_rank: int,
    schedule: str,
    virtual_stages: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
):
    """This rank's stage models (pruned copies of `model`) and their global stage indices."""
    num_stages = pp_size * virtual_stages
    counts = layers_per_stage(model.config.num_layers, num_stages, first_stage_layers, last_stage_layers)
    indices = stages_held_by_rank(schedule, pp_size, virtual_stages)[pp_rank]
    models = [build_stage(model if len(indices) == 1 else copy.deepcopy(model), i, counts) for i in indices]
    retie_on_same_rank(models)
    if model.config.moe:
        for stage_model in models:
            carry_router_totals(stage_model, RouterTotals(model.config))
    return models, indices, counts


def _as_tuple(output) -> tuple:
    return output if isinstance(output, tuple) else (output,)


class PipelineRunner:
    """Drives this rank's stages through a `torch.distributed.pipelining` schedule for one step.

    The schedule object depends on the number of micro-batches, which the batch ramp-up changes, so one is built
    (lazily) per count. The step's loss function weights and divides each micro-batch's loss itself, so the
    accumulated gradients are the step's token mean without the schedule rescaling them (ZeRO-2 moves gradients
    out of `.grad` during the backward, where a later rescale could not reach). `backward_context` wraps every
    stage backward (the DeepSpeed engine's per-micro-batch bookkeeping under ZeRO-2)."""

    def __init__(
        self,
        stage_models,
        stage_indices,
        num_stages: int,
        schedule: str,
        device,
        pp_group,
        last_stage_rank: int,
        is_first: bool,
        is_last: bool,
        backward_context=None,
    ):
        self.stage_models, self.stage_indices, self.num_stages = stage_models, stage_indices, num_stages
        self.schedule_name, self.device, self.pp_group = schedule, device, pp_group
        self.last_stage_rank, self.is_first, self.is_last = last_stage_rank, is_first, is_last
        self.backward_context = backward_context
        self._schedules: dict[int, object] = {}
        self._loss_fn = None
        self._inferring_shapes = False

    @property
    def inferring_shapes(self) -> bool:
        """torch is running the stage on placeholder activations to learn shapes: nothing may record it."""
        return self._inferring_shapes

    @contextmanager
    def _inferring_shapes_now(self):
        self._inferring_shapes = True
        try:
            yield
        finally:
            self._inferring_shapes = False

    def _schedule(self, num_microbatches: int):
        if num_microbatches not in self._schedules:
            context = self.backward_context

            # torch learns the gradients' shapes from a backward of a loss of placeholder activations (at a
            # schedule's first step and after each evaluation): no loss of ours may record it (the router's logs of
            # a mixture of experts took its routing of uninitialised memory, NaN)
            class Stage(pipeline_stage_class(self._inferring_shapes_now)):
                def backward_maybe_with_nosync(self, *args, **kwargs):
                    if context is None:
                        return super().backward_maybe_with_nosync(*args, **kwargs)
                    with context():
                        return super().backward_maybe_with_nosync(*args, **kwargs)

            stages = [
                Stage(m, i, self.num_stages, self.device, group=self.pp_group)
                for m, i in zip(self.stage_models, self.stage_indices, strict=True)
            ]
            name = self.schedule_name
            if name == "1f1b" and num_microbatches < self.num_stages:
                # Early in the batch ramp-up (MT-NLG: 32 sequences over 16 replicas = 2 micro-batches for 35
                # stages) 1F1B's warm-up already holds every micro-batch; torch's Schedule1F1B refuses that case,
                # GPipe runs it with the same results and at most num_microbatches < stages in flight.
                name = "gpipe"
            cls = schedule_class(name)

            def loss_fn(output, target):
                if self._inferring_shapes:  # depends on what the real loss depends on; its value is never used
                    # (squares: their gradients are laid out as the outputs, a sum's would be expanded views)
                    return sum(t.float().square().sum() for t in _as_tuple(output) if t.is_floating_point()) * 0.0
                return self._loss_fn(output, target)

            try:
                self._schedules[num_microbatches] = cls(
                    stages if len(stages) > 1 else stages[0],
                    n_microbatches=num_microbatches,
                    loss_fn=loss_fn,
                    scale_grads=False,
                )
            except ValueError as error:  # e.g. 1F1B needs at least as many micro-batches as stages
                raise MTNLGError(
                    f"pipeline schedule {self.schedule_name} cannot run {num_microbatches} "
                    f"micro-batches per step: {error} (raise global_batch_size or lower "
                    f"micro_batch_size: micro-batches = local batch / micro_batch_size)"
                ) from None
        return self._schedules[num_microbatches]

    def run(self, batch: dict, micro_batch_size: int, loss_fn, train: bool = True) -> torch.Tensor:
        """One step over the batch's `input_ids` and `labels`, with its `position_ids` and `document_ids` when it
        carries them (train: forward + backward of every micro-batch; else forward only). `loss_fn(output, labels)`
        is a micro-batch's share of the step's loss (already divided by the micro-batch count: the gradients are
        summed as they are). Returns the step's loss (the sum of those shares) on every rank of the pipeline."""
        input_ids, labels = batch["input_ids"], batch["labels"]
        if input_ids.shape[0] % micro_batch_size:
            raise MTNLGError(
                f"local batch {input_ids.shape[0]} is not a multiple of micro_batch_size {micro_batch_size}"
            )
        schedule = self._schedule(input_ids.shape[0] // micro_batch_size)
        self._loss_fn = loss_fn
        args = (input_ids.contiguous(),) if self.is_first else ()
        kwargs = {name: batch[name].contiguous() for name in MODEL_INPUTS if batch.get(name) is not None}
        if self.is_last:
            kwargs |= {"target": labels.contiguous(), "losses": []}
            if any(getattr(m, "mtp", None) is not None for m in self.stage_models):  # its depths embed the tokens
                kwargs["mtp_tokens"] = input_ids.contiguous()
        if train:
            schedule.step(*args, **kwargs)
        else:
            with torch.no_grad():
                schedule.eval(*args, **kwargs)
        if self.is_last:
            loss = torch.stack([loss.detach().float() for loss in kwargs["losses"]]).sum()
        else:
            loss = torch.zeros((), device=input_ids.device)
        return self.from_last_stage(loss)

    def from_last_stage(self, values: torch.Tensor) -> torch.Tensor:
        """`values` as the last stage holds them, on every rank of the pipeline (in place)."""
        dist.broadcast(values, src=self.last_stage_rank, group=self.pp_group)
        return values
