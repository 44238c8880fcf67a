"""This rank's part of a model in a layout, and the forward pass of micro-batches through the pipeline stages.

One process is the 1 x 1 x 1 layout: the same class, scorer and decoding loop serve every layout. Built from a model
source (`ShardedModel.load`: the single-process model is built on the meta device, cut by the training code's
`parallelize_gpt`, then every parameter is read as its own box of the source's model-space tensors; no rank
allocates or reads more than its share), from a training strategy's live stage models (`from_strategy`, for
`DownstreamEval`), or around a whole model in this process (`whole`).

Stages run forward only. A rank takes its (stage, micro-batch) tasks in lexicographic order, receives a stage's
input from the rank holding the previous stage (same data- and tensor-parallel coordinates) and sends its output
on without waiting (`isend`), so stage s works on micro-batch m + 1 while stage s + 1 works on m. That order
cannot deadlock for any placement of stages on ranks (looped or V-shaped): the smallest unfinished task always has
its input ready. Every rank of a replica knows every micro-batch's shape (they read the same requests), so
activations travel without shape messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mtnlg_lightning.checkpoint.model_space import PARALLEL_MARKS, model_buffers, model_slots
from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.model import GPT
from mtnlg_lightning.moe import routing_alone
from mtnlg_lightning.parallel import context_parallel, deepspeed_compat, sequence_parallel
from mtnlg_lightning.parallel.layout import ProcessGroups
from mtnlg_lightning.parallel.parallelize import parallelize_gpt
from mtnlg_lightning.parallel.pipeline import stages_held_by_rank


@dataclass
class StageTimes:
    """Seconds this rank spent computing stages vs. the wall time of the forward passes (pipeline feeding)."""

    busy: float = 0.0
    wall: float = 0.0

    @property
    def busy_fraction(self) -> float:
        return self.busy / self.wall if self.wall else 0.0


class ShardedModel:
    """This rank's stage models (TP-sharded, global stage indices) and how to run micro-batches through them."""

    def __init__(
        self,
        config: ModelConfig,
        groups: ProcessGroups,
        stages: list[tuple[int, nn.Module]],
        num_stages: int,
        placement: list[list[int]],
        device: torch.device,
        sequence_parallel: bool = False,
        whole_sequences: bool = False,
    ):
        self.config, self.groups, self.device = config, groups, device
        self.stages, self.num_stages, self.sequence_parallel = stages, num_stages, sequence_parallel
        # the CP ranks' share of a sequence: 1 where each runs whole sequences (`decoding`)
        self.context_parallel = 1 if whole_sequences else groups.layout.context_parallel
        self.holder = {s: r for r, held in enumerate(placement) for s in held}  # stage -> pipeline rank
        self.times = StageTimes()
        self.dtype = next(stages[0][1].parameters()).dtype

    # ------------------------------------------------------------------ coordinates
    @property
    def layout(self):
        return self.groups.layout

    @property
    def tp_group(self):
        return self.groups.tensor_parallel_group if self.layout.tensor_parallel > 1 else None

    @property
    def is_first(self) -> bool:
        return any(s == 0 for s, _ in self.stages)

    @property
    def is_last(self) -> bool:
        return any(s == self.num_stages - 1 for s, _ in self.stages)

    def stage_rank(self, stage: int) -> int:
        """The global rank holding `stage` in this rank's replica and TP position."""
        c = self.groups.coord
        return self.layout.rank(self.holder[stage], c.dp, c.tp, c.cp)

    @property
    def last_stage_rank(self) -> int:
        return self.stage_rank(self.num_stages - 1)

    def modules(self):
        return [m for _, m in self.stages]

    # ------------------------------------------------------------------ building
    @classmethod
    def load(
        cls, weights, config: ModelConfig, groups: ProcessGroups, device, dtype, pipeline, sequence_parallel, kernel
    ):
        """This rank's shard of the model-space `weights` (a `checkpoint.model_state.LazyWeights`)."""
        with torch.device("meta"):
            model = GPT(config)
        parallel = parallelize_gpt(model, groups, torch.device(device), pipeline, sequence_parallel, kernel)
        if parallel.pipeline is not None:
            indices, modules = parallel.pipeline.stage_indices, parallel.pipeline.stage_models
        else:
            indices, modules = [0], [parallel.model]
        tp_rank, tp_size = groups.tensor_parallel_rank, groups.tensor_parallel_size
        for module in modules:
            _materialize(module, weights, config, tp_rank, tp_size, device, dtype)
            module.eval()
        num_stages = groups.layout.pipeline_parallel * pipeline.virtual_stages
        placement = stages_held_by_rank(pipeline.schedule, groups.layout.pipeline_parallel, pipeline.virtual_stages)
        return cls(
            config, groups, list(zip(indices, modules, strict=True)), num_stages, placement, device, sequence_parallel
        )

    @classmethod
    def whole(cls, model: nn.Module) -> ShardedModel:
        """A whole single-process model as the 1 x 1 x 1 layout (no process group needed)."""
        device = next(model.parameters()).device
        return cls(model.config, ProcessGroups.single(), [(0, model)], 1, [[0]], device)

    @classmethod
    def from_strategy(cls, strategy, whole_sequences: bool = False) -> ShardedModel:
        """The live stage models of a `MegatronDeepSpeedStrategy` (weights as trained so far). `whole_sequences`:
        each rank runs whole sequences, neither cut over TP (sequence parallelism) nor over CP (`decoding`)."""
        runner = strategy.pipeline
        if runner is not None:
            stages = list(zip(runner.stage_indices, runner.stage_models, strict=True))
            num_stages = runner.num_stages
        else:
            stages, num_stages = [(0, strategy.lightning_module.model)], 1
        settings = strategy.pipeline_settings
        placement = stages_held_by_rank(settings.schedule, strategy.pipeline_parallel, settings.virtual_stages)
        return cls(
            strategy.lightning_module.config,
            strategy.groups,
            stages,
            num_stages,
            placement,
            strategy.root_device,
            strategy.sequence_parallel and not whole_sequences,
            whole_sequences,
        )

    @classmethod
    @contextmanager
    def decoding(cls, strategy):
        """The live stage models of a `MegatronDeepSpeedStrategy` set up to decode for a while (generation inside
        training): whole sequences on every rank (sequence and context parallelism suspended, `whole_sequences` of
        each), a mixture of experts' router statistics kept local, and under ZeRO-3 the parameters gathered whole
        with DeepSpeed's per-module hooks off (the data-parallel ranks decode different numbers of passes). The
        weights are the training ones, in place; everything is restored on the way out."""
        model = cls.from_strategy(strategy, whole_sequences=True)
        modules = model.modules()
        with ExitStack() as stack:
            stack.enter_context(sequence_parallel.whole_sequences(modules))
            stack.enter_context(context_parallel.whole_sequences(modules))
            stack.enter_context(routing_alone(modules))
            if strategy.engine is not None and strategy.zero_stage == 3:
                stack.enter_context(deepspeed_compat.whole_parameters_without_hooks(strategy.engine))
            yield model

    # ------------------------------------------------------------------ running
    def padded_width(self, width: int) -> int:
        """Context parallelism cuts the sequence into 2 x CP chunks, sequence parallelism a rank's part over TP:
        widths are rounded up to a multiple of what they cut (right padding: no real token attends to it)."""
        multiple = 2 * self.context_parallel if self.context_parallel > 1 else 1
        multiple *= self.layout.tensor_parallel if self.sequence_parallel else 1
        return -(-width // multiple) * multiple

    def local_positions(self, width: int) -> torch.Tensor:
        """The positions of a `width`-token sequence whose outputs this rank's last stage produces (all of them
        without context parallelism; this rank's two chunks with it)."""
        cp = self.context_parallel
        if cp == 1:
            return torch.arange(width)
        return context_parallel.local_positions(self.groups.coord.cp, cp, 0, width // cp, "cpu")

    @torch.no_grad()
    def forward(
        self,
        micro_batches: list[torch.Tensor | tuple[int, int]],
        on_output: Callable[[int, torch.Tensor], None],
        caches: list | None = None,
    ) -> None:
        """Run micro-batches through the pipeline. `micro_batches[m]` is the token tensor [b, S] on the first
        stage's ranks and its (b, S) shape elsewhere; `on_output(m, logits)` is called on the last stage's ranks
        with this rank's vocabulary slice [b, S, V/TP]. `caches[m]`: the micro-batch's KV cache (decoding)."""
        with _activations_only(module for _, module in self.stages):
            self._forward(micro_batches, on_output, caches)

    def _forward(self, micro_batches, on_output, caches) -> None:
        started = time.perf_counter()
        pending, local = [], {}
        hidden, tp = self.config.hidden_size, self.layout.tensor_parallel
        for stage, module in sorted(self.stages, key=lambda sm: sm[0]):
            for m, batch in enumerate(micro_batches):
                if stage == 0:
                    x = batch.to(self.device)
                elif self.holder[stage - 1] == self.groups.coord.pp:
                    x = local.pop((stage - 1, m))
                else:
                    b, width = batch.shape if isinstance(batch, torch.Tensor) else batch
                    width //= self.context_parallel  # this rank's chunks
                    width = width // tp if self.sequence_parallel else width
                    x = torch.empty(b, width, hidden, dtype=self.dtype, device=self.device)
                    dist.recv(x, src=self.stage_rank(stage - 1))
                busy = time.perf_counter()
                out = module(x, caches[m]) if caches is not None else module(x)
                self.times.busy += time.perf_counter() - busy
                if stage == self.num_stages - 1:
                    on_output(m, out)
                elif self.holder[stage + 1] == self.groups.coord.pp:
                    local[(stage, m)] = out
                else:
                    out = out.contiguous()
                    pending.append((dist.isend(out, dst=self.stage_rank(stage + 1)), out))
        for work, _ in pending:
            work.wait()
        self.times.wall += time.perf_counter() - started


@contextmanager
def _activations_only(modules):
    """A mixture of experts' training stages pass its router statistics on with the activations
    (`pipeline.carry_router_totals`), which serve only the training loss: here the stages pass activations."""
    carrying = [m for m in modules if getattr(m, "carries_router_totals", False)]
    for module in carrying:
        module.carries_router_totals = False
    try:
        yield
    finally:
        for module in carrying:
            module.carries_router_totals = True


# ---------------------------------------------------------------------------------------------- loading
def _materialize(module: nn.Module, weights, config: ModelConfig, tp_rank: int, tp_size: int, device, dtype) -> None:
    """Allocate a meta stage model on `device` and fill every parameter with its box of the model-space weights."""
    slots = model_slots(module, config, tp_rank, tp_size)  # read while the TP attributes are on the meta tensors
    head = getattr(module, "lm_head", None)
    head_copy = None  # a last stage's own copy of the tied embedding: a plain tensor, not a parameter
    if head is not None and config.tie_embeddings and not any(head.weight is s.param for s in slots):
        head_copy = head.weight
    tied = head is not None and getattr(module, "embed", None) is not None and config.tie_embeddings
    marks = {s.name: {k: getattr(s.param, k) for k in PARALLEL_MARKS if hasattr(s.param, k)} for s in slots}
    module.to_empty(device=device)
    module.to(dtype)
    params = dict(module.named_parameters())
    for slot in slots:
        param = params[slot.name]
        for key, value in marks[slot.name].items():  # to_empty made new parameters: mark them as the old ones
            setattr(param, key, value)
        tied_head = slot.name == "lm_head.weight" and config.tie_embeddings  # re-tied on a V-shaped rank
        name = "embed.wte.weight" if tied_head else slot.name
        value = weights.read_box(name, slot.offsets, slot.shape).to(dtype)
        with torch.no_grad():
            slot.fill(param.data, value.to(device))
    for name, buffer in model_buffers(module):  # whole on every rank holding its block (fp32: `MoE._apply`)
        with torch.no_grad():
            buffer.copy_(weights.read_box(name, (0,) * buffer.dim(), tuple(buffer.shape)).to(device, buffer.dtype))
    if tied:  # to_empty gave the head its own tensor: share the embedding's again, as the model does
        module.lm_head.weight = module.embed.wte.weight
    elif head_copy is not None:
        rows = head_copy.shape[0]
        start = tp_rank * rows
        stored = max(0, min(rows, config.vocab_size - start))
        weight = torch.zeros(head_copy.shape, dtype=dtype, device=device)
        weight[:stored] = weights.read_box("embed.wte.weight", (start, 0), (stored, config.hidden_size)).to(dtype)
        module.lm_head.weight = weight
