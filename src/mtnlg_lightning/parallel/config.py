"""The parallel layout a run asks for, read once from the strategy's arguments, and every check of it in one place.

    trainer:
      strategy:
        class_path: mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy   # or mtnlg_lightning.strategy....
        init_args: {tensor_parallel: 2, pipeline_parallel: 2, zero_stage: 1}

The trainer (the strategy and `mtnlg fit`'s parse-time check), `mtnlg-eval`/`mtnlg-generate --strategy`, the dry run
and the planner all build a `ParallelConfig` here (`from_strategy`, `read_strategy_file`) and call its `validate`:
one set of defaults, one set of one-line errors, so a layout one of them refuses is refused by all. Other
strategies (ddp, single_device, ...) are data parallelism only. Everything is arithmetic: no process or weight is
needed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.parallel.context_parallel import KERNELS, check_context_parallel
from mtnlg_lightning.parallel.layout import ParallelLayout, check_model_split
from mtnlg_lightning.parallel.pipeline import MULTI_STAGE, V_SHAPED, layers_per_stage, schedule_class
from mtnlg_lightning.parallel.sequence_parallel import check_sequence_length

STRATEGY_PATHS = (
    "mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy",
    "mtnlg_lightning.strategy.MegatronDeepSpeedStrategy",  # the path before round 4, which configs keep using
)
# The strategy's arguments that say how it runs, not where the ranks are (the rest are `ParallelConfig`'s fields).
RUNTIME_ARGS = ("deepspeed_config", "print_layout", "process_group_backend", "timeout", "async_save")


@dataclass(frozen=True)
class PipelineParallelSettings:
    """How the model is cut into pipeline stages and scheduled."""

    schedule: str = "1f1b"
    virtual_stages: int = 1  # stages per pipeline rank (interleaved and V-shaped schedules hold several)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """The layout axes and how each is run; data parallelism is what is left of the world (`layout`).

    Built without checks (a bad value is reported by `validate`, as one line, where the caller can say it)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    virtual_pipeline_stages: int | None = None  # None: 2 for the multi-stage schedules, else 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    zero_stage: int = 1
    sequence_parallel: bool = False
    context_parallel: int = 1
    context_parallel_kernel: str = "auto"
    expert_parallel: int = 1  # DP ranks splitting a mixture of experts' experts (carved out of DP)
    gpus_per_node: int | None = None  # None: the caller's node size (launcher, trainer.devices, --gpus-per-node)
    allow_tp_across_nodes: bool = False

    def __post_init__(self) -> None:
        if self.virtual_pipeline_stages is None:
            multi = isinstance(self.pipeline_schedule, str) and self.pipeline_schedule in MULTI_STAGE
            object.__setattr__(self, "virtual_pipeline_stages", 2 if multi else 1)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_init_args(cls, args, where: str = "trainer.strategy.init_args") -> ParallelConfig:
        """The layout of our strategy's `init_args`; its runtime arguments are accepted and left to it."""
        if not isinstance(args, dict):
            raise MTNLGError(f"{where} must be a mapping of the strategy's arguments, got {args!r}")
        layout_keys = {f.name for f in fields(cls)}
        known = layout_keys | set(RUNTIME_ARGS)
        unknown = sorted(set(args) - known)
        if unknown:
            raise MTNLGError(f"{where} has unknown key(s) {unknown}; valid: {sorted(known)}")
        return cls(**{key: value for key, value in args.items() if key in layout_keys})

    @classmethod
    def from_strategy(cls, spec, where: str = "trainer.strategy") -> ParallelConfig:
        """The layout of a `trainer.strategy` value: a name (`ddp`, `auto`, ...) or a class_path/init_args mapping
        naming our strategy by either import path; any other strategy is data parallelism only."""
        if spec is None or isinstance(spec, str):
            return cls(zero_stage=0)
        if not isinstance(spec, dict):
            raise MTNLGError(f"{where} must be a strategy name or a mapping with class_path and init_args")
        class_path = spec.get("class_path")
        if not class_path:
            raise MTNLGError(f"{where} has no class_path (ours is {STRATEGY_PATHS[0]})")
        if class_path in STRATEGY_PATHS:
            return cls.from_init_args(spec.get("init_args") or {}, f"{where}.init_args")
        return cls(zero_stage=0)

    # ------------------------------------------------------------------ derived
    @property
    def pipeline(self) -> PipelineParallelSettings:
        return PipelineParallelSettings(
            self.pipeline_schedule, self.virtual_pipeline_stages, self.first_stage_layers, self.last_stage_layers
        )

    @property
    def sequence_multiple(self) -> int:
        """What a sequence's length must be a multiple of: the 2 x CP chunks, each rank's part cut over TP by SP."""
        chunks = 2 * self.context_parallel if self.context_parallel > 1 else 1
        return chunks * (self.tensor_parallel if self.sequence_parallel else 1)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Blocks per pipeline stage (all PP x virtual stages, in order)."""
        stages = self.pipeline_parallel * self.virtual_pipeline_stages
        return layers_per_stage(num_layers, stages, self.first_stage_layers, self.last_stage_layers)

    def layout(self, world_size: int, gpus_per_node: int | None = None) -> ParallelLayout:
        """The rank grid over `world_size` ranks (checked: the world divides, TP groups stay inside a node);
        `gpus_per_node` is the caller's node size, used when the config names none."""
        return ParallelLayout(
            world_size,
            self.tensor_parallel,
            self.pipeline_parallel,
            self.gpus_per_node or gpus_per_node,
            self.allow_tp_across_nodes,
            self.context_parallel,
            self.expert_parallel,
        )

    def describe(self, world_size: int) -> dict:
        """The layout as results files record it (generation and evaluation run with the experts whole: no EP)."""
        return {
            "world_size": world_size,
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "data_parallel": world_size // (self.tensor_parallel * self.context_parallel * self.pipeline_parallel),
            "pipeline_schedule": self.pipeline_schedule,
            "virtual_pipeline_stages": self.virtual_pipeline_stages,
            "sequence_parallel": self.sequence_parallel,
            "context_parallel": self.context_parallel,
        }

    # ------------------------------------------------------------------ checks
    def validate(
        self, model_config=None, world_size: int | None = None, *, inference: bool = False, gpus_per_node=None
    ) -> ParallelLayout | None:
        """Every check, in one order, each failure one line: the arguments; with `model_config`, the model's split
        (heads, key/value heads, vocabulary, blocks per stage, the sequence cut by SP and CP); with `world_size`,
        the rank grid, which is returned.

        `inference`: the sequence is each request's, padded to `sequence_multiple` (`ShardedModel.padded_width`),
        not the model's seq_len, and nothing runs dropout: neither is checked."""
        self._check_arguments()
        if model_config is not None:
            self._check_model(model_config, inference)
        return None if world_size is None else self.layout(world_size, gpus_per_node)

    def _check_arguments(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MTNLGError(f"{name} must be a positive integer, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3) or isinstance(self.zero_stage, bool):
            raise MTNLGError(f"zero_stage {self.zero_stage} is not one of 0 (plain DP), 1, 2, 3")
        schedule, virtual = self.pipeline_schedule, self.virtual_pipeline_stages
        schedule_class(schedule if isinstance(schedule, str) else repr(schedule))  # unknown: the known ones listed
        multi = schedule in MULTI_STAGE
        if not isinstance(virtual, int) or virtual < 1 or multi != (virtual > 1):
            raise MTNLGError(
                f"pipeline_schedule {schedule} takes {'2 or more' if multi else '1'} virtual_pipeline_stages, "
                f"got {virtual}"
            )
        if schedule in V_SHAPED and virtual != 2:
            raise MTNLGError(f"schedule {schedule} needs exactly 2 stages per rank, got {virtual}")
        if self.pipeline_parallel > 1 and self.zero_stage == 3:
            raise MTNLGError(
                "zero_stage 3 partitions parameters a pipeline stage needs whole: use zero_stage 1 or "
                "2 with pipeline_parallel > 1"
            )
        if schedule in V_SHAPED and self.zero_stage == 2:
            raise MTNLGError(
                f"pipeline_schedule {schedule} splits the backward in two, which ZeRO-2's "
                f"gradient bookkeeping does not follow: use zero_stage 0 or 1 with it"
            )
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise MTNLGError("sequence_parallel shards over the tensor-parallel group: it needs tensor_parallel > 1")
        if self.context_parallel > 1 and self.context_parallel_kernel not in KERNELS:
            raise MTNLGError(
                f"context_parallel_kernel {self.context_parallel_kernel!r} is not one of {', '.join(KERNELS)}"
            )

    def _check_model(self, config, inference: bool) -> None:
        tp, ep = self.tensor_parallel, self.expert_parallel
        if ep > 1:
            if not getattr(config, "moe", False):
                raise MTNLGError(f"expert_parallel {ep} needs a mixture-of-experts model (num_experts > 0)")
            if config.num_experts % ep:
                raise MTNLGError(f"num_experts {config.num_experts} is not divisible by expert_parallel {ep}")
        if getattr(config, "qk_norm_over", "head") == "projection" and tp > 1:
            raise MTNLGError(
                f"tensor_parallel {tp}: q/k norms over the whole projection (OLMoE) would need the sum of squares "
                f"of every rank's heads; only per-head q/k norms are split"
            )
        kv_heads = None if config.fused_qkv else config.num_kv_heads
        # The vocabulary as the model builds it (padded once, not per TP degree), split into TP slices.
        check_model_split(tp, self.pipeline_parallel, config.num_heads, config.padded_vocab_size(), config.num_layers,
                          kv_heads)  # fmt: skip
        seq_len = self.sequence_multiple if inference else config.seq_len
        if self.sequence_parallel:
            check_sequence_length(seq_len, tp)
        self.stage_layers(config.num_layers)
        dropout = 0.0 if inference else config.attention_dropout
        check_context_parallel(self.context_parallel, seq_len, tp, self.sequence_parallel,
                               self.context_parallel_kernel, dropout)  # fmt: skip


def read_strategy_file(path: str | Path) -> ParallelConfig:
    """The layout of a strategy YAML (configs/strategy/*.yaml, or what `mtnlg-plan --write-config` wrote)."""
    file = Path(path)
    if not file.is_file():
        raise MTNLGError(f"strategy file {path} does not exist")
    try:
        spec = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise MTNLGError(f"strategy file {path} is not valid YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(spec, str | dict):
        raise MTNLGError(f"strategy file {path} must hold a mapping with class_path and init_args")
    return ParallelConfig.from_strategy(spec, f"strategy file {path}")
