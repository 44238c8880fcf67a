"""Validate a `mtnlg fit` config for a cluster we do not have: layout, per-stage meta models, batches, memory."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import yaml

from mtnlg_lightning.config import ModelConfig, deep_merge, get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import count_parameters
from mtnlg_lightning.gpus import ALIASES, GPUS
from mtnlg_lightning.model import build_model
from mtnlg_lightning.parallel.config import ParallelConfig
from mtnlg_lightning.parallel.layout import ParallelLayout
from mtnlg_lightning.parallel.pipeline import split_into_stages
from mtnlg_lightning.parallel.tensor_parallel import apply_tensor_parallel
from mtnlg_lightning.planning.inference_plan import inference_report
from mtnlg_lightning.planning.planner import format_plan, plan
from mtnlg_lightning.train.lr_batch_schedules import BatchSizeSchedule


def load_configs(paths: list[str]) -> dict:
    merged: dict = {}
    for path in paths:
        if not Path(path).exists():
            raise MTNLGError(f"config {path} does not exist")
        try:
            merged = deep_merge(merged, yaml.safe_load(Path(path).read_text()) or {})
        except yaml.YAMLError as error:
            raise MTNLGError(f"{path} is not valid YAML: {str(error).splitlines()[0]}") from None
    return merged


def _check_keys(args: dict, cls, where: str) -> None:
    known = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise MTNLGError(f"{where} has unknown key(s) {unknown}; valid: {sorted(known)}")


def _stage_parameters(model_config, parallel: ParallelConfig, pp_rank: int) -> int:
    full = build_model(model_config, device="meta")
    pipeline = parallel.pipeline
    stage_models, _, _ = split_into_stages(
        full,
        parallel.pipeline_parallel,
        pp_rank,
        pipeline.schedule,
        pipeline.virtual_stages,
        pipeline.first_stage_layers,
        pipeline.last_stage_layers,
    )
    for stage in stage_models:
        apply_tensor_parallel(stage, None, 0, parallel.tensor_parallel)
    return sum(p.numel() for stage in stage_models for p in stage.parameters())


@dataclass
class _Setup:
    """What a config asks for, checked: the world and its layout, the model, the pipeline stages, the batches."""

    parallel: ParallelConfig
    nodes: int
    devices: int
    layout: ParallelLayout
    model_config: ModelConfig
    counts: list[int]  # blocks per stage
    micro: int
    batches: BatchSizeSchedule

    @property
    def world(self) -> int:
        return self.nodes * self.devices

    @property
    def tp(self) -> int:
        return self.parallel.tensor_parallel

    @property
    def pp(self) -> int:
        return self.parallel.pipeline_parallel

    @property
    def cp(self) -> int:
        return self.parallel.context_parallel

    @property
    def virtual(self) -> int:
        """Stages per pipeline rank."""
        return self.parallel.virtual_pipeline_stages

    def micro_batches(self, batch: int) -> int:
        """Micro-batches per pipeline for a global batch of `batch` sequences."""
        return batch // (self.micro * self.layout.data_parallel)


def dry_run(config_paths: list[str], gpu: str = "a100-80g", recompute: str | None = None) -> str:
    config = load_configs(config_paths)
    trainer, model_args = config.get("trainer") or {}, config.get("model") or {}
    parallel = ParallelConfig.from_strategy(trainer.get("strategy"))  # read as `mtnlg fit` reads it
    # The module imports Lightning (seconds): a config that fails to load is reported first.
    from mtnlg_lightning.train.module import MTNLGModule

    _check_keys(model_args, MTNLGModule, "model")
    setup = _setup(trainer, parallel, model_args)
    recompute = recompute or _recompute_mode(model_args, trainer.get("callbacks") or [])
    return "\n".join(
        [
            f"dry run of {', '.join(config_paths)}: OK",
            *_summary_lines(setup, _parameters_per_stage(setup)),
            *_memory_lines(setup, gpu, recompute),
            _inference_lines(setup.model_config, gpu, setup.micro, setup.layout.ranks_per_node),
        ]
    )


def _setup(trainer: dict, parallel: ParallelConfig, model_args: dict) -> _Setup:
    """The layout, the model and the batch schedule of the config, each checked as the trainer checks them."""
    nodes, devices = int(trainer.get("num_nodes", 1)), trainer.get("devices", 1)
    if not isinstance(devices, int):
        raise MTNLGError(f"trainer.devices must be a number of devices per node for a dry run, got {devices!r}")
    model_config = get_config(model_args.get("preset", "tiny"), **(model_args.get("model_overrides") or {}))
    layout = parallel.validate(model_config, nodes * devices, gpus_per_node=devices)
    micro = int(model_args.get("micro_batch_size", 8))
    ramp = model_args.get("rampup_batch_size") or [None, None, 0]
    batches = BatchSizeSchedule(int(model_args.get("global_batch_size", 8)), *ramp)
    batches.check_divisible(micro, layout.data_parallel)
    counts = parallel.stage_layers(model_config.num_layers)
    return _Setup(parallel, nodes, devices, layout, model_config, counts, micro, batches)


def _parameters_per_stage(s: _Setup) -> list[int]:
    """Parameters per pipeline rank, of every distinct stage built on the meta device and TP-sharded as one TP rank
    holds it: real module code, no memory. With one stage per rank and equal middle stages, the first, one middle
    and the last rank are all the kinds."""
    uniform_middle = s.virtual == 1 and len(set(s.counts[1:-1])) <= 1
    ranks = sorted({0, min(1, s.pp - 1), s.pp - 1}) if uniform_middle else list(range(s.pp))
    params_of = {r: _stage_parameters(s.model_config, s.parallel, r) for r in ranks}
    return [params_of.get(r, params_of.get(min(1, s.pp - 1))) for r in range(s.pp)]


def _recompute_mode(model_args: dict, callbacks: list) -> str:
    """The activation recompute the run applies: an ActivationCheckpointing callback's mode (it sets the model's),
    else the model's `activation_checkpointing` (none without either)."""
    modes = [
        (c.get("init_args") or {}).get("mode", "selective")
        for c in callbacks
        if isinstance(c, dict) and c.get("class_path", "").endswith("ActivationCheckpointing")
    ]
    mode = modes[0] if modes else model_args.get("activation_checkpointing", "none")
    return mode if mode in ("full", "selective") else "none"


def _summary_lines(s: _Setup, params_per_stage: list[int]) -> list[str]:
    """The model, the layout, the stages, the parameters per GPU and the batches, a line each."""
    config, layout, batches = s.model_config, s.layout, s.batches
    first_batch = batches.batch_size(0)
    micro_first, micro_full = s.micro_batches(first_batch), s.micro_batches(batches.global_batch_size)
    return [
        f"  model        {config.name}: {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads} heads, seq {config.seq_len}, vocab {config.vocab_size} -> "
        f"{config.padded_vocab_size()} padded; {count_parameters(config) / 1e9:,.1f}B parameters",
        f"  layout       world {s.world} = {s.nodes} node(s) x {s.devices}: pp {s.pp} x dp {layout.data_parallel} x "
        + (f"cp {s.cp} (each sequence's {config.seq_len} tokens in 2 x {s.cp} chunks) x " if s.cp > 1 else "")
        + f"tp {s.tp}; "
        f"TP groups inside a node: {'yes' if s.tp <= layout.ranks_per_node else 'NO'}",
        f"  stages       {s.pp * s.virtual} ({s.parallel.pipeline_schedule}, {s.virtual} per rank); blocks per stage "
        f"{s.counts[0] if len(set(s.counts)) == 1 else s.counts}",
        f"  params/GPU   first {params_per_stage[0] / 1e9:.3f}B, middle "
        f"{params_per_stage[len(params_per_stage) // 2] / 1e9:.3f}B, last {params_per_stage[-1] / 1e9:.3f}B "
        f"(built on the meta device, TP-sharded)",
        f"  batches      {first_batch} -> {batches.global_batch_size} sequences (ramp over {batches.rampup_samples:,} "
        f"samples, {batches.steps_for_samples(batches.rampup_samples):,} steps); micro-batches per pipeline "
        f"{micro_first} -> {micro_full}"
        + ("  (fewer than the stages early in the ramp: run as GPipe order)" if micro_first < s.pp * s.virtual else ""),
    ]


def _memory_lines(s: _Setup, gpu: str, recompute: str) -> list[str]:
    """The planner's estimate for the config; with TP, the memory per GPU with and without sequence parallelism."""
    sequence_parallel = s.parallel.sequence_parallel

    def estimate_with(sp: bool):
        return plan(
            s.model_config,
            s.tp,
            s.pp,
            s.layout.data_parallel,
            s.layout.ranks_per_node,
            gpu,
            s.batches.global_batch_size,
            s.micro,
            recompute,
            s.parallel.zero_stage,
            layers=s.counts if s.virtual == 1 else None,
            virtual_stages=s.virtual,
            sequence_parallel=sp,
            cp=s.cp,
        )

    lines = [format_plan(estimate_with(sequence_parallel))]
    # Sequence parallelism shards the LayerNorm/dropout/residual activations over TP (Korthikanti et al. 2022):
    # show the memory per GPU both ways so the choice is visible.
    if s.tp > 1 and (s.model_config.seq_len // s.cp) % s.tp == 0:
        without, with_sp = estimate_with(False), estimate_with(True)
        lines.append(
            f"  sequence par. memory per GPU without SP {without.total_gb:,.1f} GB (activations "
            f"{without.activation_gb:,.1f} GB), with SP {with_sp.total_gb:,.1f} GB (activations "
            f"{with_sp.activation_gb:,.1f} GB); this config: SP {'on' if sequence_parallel else 'off'}"
        )
    return lines


def _inference_lines(model_config, gpu: str, micro: int, gpus_per_node: int) -> str:
    """After training: how many GPUs evaluating this model takes, on this config's GPU first, then the others."""
    chosen = ALIASES.get(gpu.lower(), gpu.lower())
    kinds = [chosen] + sorted(name for name in GPUS if name != chosen)
    return inference_report(model_config, kinds, micro, None, "bf16", gpus_per_node)
