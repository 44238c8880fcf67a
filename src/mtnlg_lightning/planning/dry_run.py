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
from mtnlg_lightning.parallel.context_parallel import check_context_parallel
from mtnlg_lightning.parallel.layout import ParallelLayout
from mtnlg_lightning.parallel.pipeline import MULTI_STAGE, layers_per_stage, split_into_stages
from mtnlg_lightning.parallel.tensor_parallel import apply_tensor_parallel
from mtnlg_lightning.planning.inference_plan import inference_report
from mtnlg_lightning.planning.planner import format_plan, plan
from mtnlg_lightning.train.lr_batch_schedules import BatchSizeSchedule

STRATEGY = "mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy"


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


def _init_args(section, name: str) -> dict:
    if not isinstance(section, dict) or section.get("class_path") != STRATEGY:
        raise MTNLGError(f"trainer.strategy must be {STRATEGY} for a dry run, got {name!r}")
    return section.get("init_args") or {}


def _check_keys(args: dict, cls, where: str) -> None:
    known = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise MTNLGError(f"{where} has unknown key(s) {unknown}; valid: {sorted(known)}")


def _stage_parameters(model_config, pp: int, pp_rank: int, schedule: str, virtual: int, strategy: dict, tp: int) -> int:
    full = build_model(model_config, device="meta")
    stage_models, _, _ = split_into_stages(
        full, pp, pp_rank, schedule, virtual, strategy.get("first_stage_layers"), strategy.get("last_stage_layers")
    )
    for stage in stage_models:
        apply_tensor_parallel(stage, None, 0, tp)
    return sum(p.numel() for stage in stage_models for p in stage.parameters())


@dataclass
class _Setup:
    """What a config asks for, checked: the world and its layout, the model, the pipeline stages, the batches."""

    strategy: dict
    nodes: int
    devices: int
    tp: int
    pp: int
    cp: int
    layout: ParallelLayout
    model_config: ModelConfig
    schedule: str
    virtual: int  # stages per pipeline rank
    counts: list[int]  # blocks per stage
    micro: int
    batches: BatchSizeSchedule

    @property
    def world(self) -> int:
        return self.nodes * self.devices

    def micro_batches(self, batch: int) -> int:
        """Micro-batches per pipeline for a global batch of `batch` sequences."""
        return batch // (self.micro * self.layout.data_parallel)


def dry_run(config_paths: list[str], gpu: str = "a100-80g", recompute: str | None = None) -> str:
    config = load_configs(config_paths)
    trainer, model_args = config.get("trainer") or {}, config.get("model") or {}
    strategy = _init_args(trainer.get("strategy"), str(trainer.get("strategy")))
    # The module and the strategy import Lightning (seconds): a config that fails to load is reported first.
    from mtnlg_lightning.train.module import MTNLGModule
    from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy

    _check_keys(strategy, MegatronDeepSpeedStrategy, "trainer.strategy.init_args")
    _check_keys(model_args, MTNLGModule, "model")
    setup = _setup(trainer, strategy, model_args)
    recompute = recompute or _recompute_mode(trainer.get("callbacks") or [])
    return "\n".join(
        [
            f"dry run of {', '.join(config_paths)}: OK",
            *_summary_lines(setup, _parameters_per_stage(setup)),
            *_memory_lines(setup, gpu, recompute),
            _inference_lines(setup.model_config, gpu, setup.micro, setup.layout.ranks_per_node),
        ]
    )


def _setup(trainer: dict, strategy: dict, model_args: dict) -> _Setup:
    """The layout, the model and the batch schedule of the config, each checked as the trainer would."""
    nodes, devices = int(trainer.get("num_nodes", 1)), trainer.get("devices", 1)
    if not isinstance(devices, int):
        raise MTNLGError(f"trainer.devices must be a number of devices per node for a dry run, got {devices!r}")
    tp, pp = int(strategy.get("tensor_parallel", 1)), int(strategy.get("pipeline_parallel", 1))
    cp = int(strategy.get("context_parallel", 1))
    schedule = strategy.get("pipeline_schedule", "1f1b")
    virtual = strategy.get("virtual_pipeline_stages") or (2 if schedule in MULTI_STAGE else 1)
    gpus_per_node, across = strategy.get("gpus_per_node") or devices, bool(strategy.get("allow_tp_across_nodes", False))
    layout = ParallelLayout(nodes * devices, tp, pp, gpus_per_node, across, cp)
    model_config = get_config(model_args.get("preset", "tiny"), **(model_args.get("model_overrides") or {}))
    layout.validate_model(model_config.num_heads, model_config.padded_vocab_size(tp), model_config.num_layers)
    check_context_parallel(
        cp,
        model_config.seq_len,
        tp,
        bool(strategy.get("sequence_parallel", False)),
        strategy.get("context_parallel_kernel", "auto"),
        model_config.attention_dropout,
    )
    counts = layers_per_stage(
        model_config.num_layers, pp * virtual, strategy.get("first_stage_layers"), strategy.get("last_stage_layers")
    )
    micro = int(model_args.get("micro_batch_size", 8))
    ramp = model_args.get("rampup_batch_size") or [None, None, 0]
    batches = BatchSizeSchedule(int(model_args.get("global_batch_size", 8)), *ramp)
    batches.check_divisible(micro, layout.data_parallel)
    return _Setup(strategy, nodes, devices, tp, pp, cp, layout, model_config, schedule, virtual, counts, micro, batches)


def _parameters_per_stage(s: _Setup) -> list[int]:
    """Parameters per pipeline rank, of every distinct stage built on the meta device and TP-sharded as one TP rank
    holds it: real module code, no memory. With one stage per rank and equal middle stages, the first, one middle
    and the last rank are all the kinds."""
    uniform_middle = s.virtual == 1 and len(set(s.counts[1:-1])) <= 1
    ranks = sorted({0, min(1, s.pp - 1), s.pp - 1}) if uniform_middle else list(range(s.pp))
    params_of = {r: _stage_parameters(s.model_config, s.pp, r, s.schedule, s.virtual, s.strategy, s.tp) for r in ranks}
    return [params_of.get(r, params_of.get(min(1, s.pp - 1))) for r in range(s.pp)]


def _recompute_mode(callbacks: list) -> str:
    """The activation recompute of the config's ActivationCheckpointing callback (none without one)."""
    modes = [
        (c.get("init_args") or {}).get("mode")
        for c in callbacks
        if isinstance(c, dict) and c.get("class_path", "").endswith("ActivationCheckpointing")
    ]
    return modes[0] if modes and modes[0] in ("full", "selective") else "none"


def _summary_lines(s: _Setup, params_per_stage: list[int]) -> list[str]:
    """The model, the layout, the stages, the parameters per GPU and the batches, a line each."""
    config, layout, batches = s.model_config, s.layout, s.batches
    first_batch = batches.batch_size(0)
    micro_first, micro_full = s.micro_batches(first_batch), s.micro_batches(batches.global_batch_size)
    return [
        f"  model        {config.name}: {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads} heads, seq {config.seq_len}, vocab {config.vocab_size} -> "
        f"{config.padded_vocab_size(s.tp)} padded; {count_parameters(config) / 1e9:,.1f}B parameters",
        f"  layout       world {s.world} = {s.nodes} node(s) x {s.devices}: pp {s.pp} x dp {layout.data_parallel} x "
        + (f"cp {s.cp} (each sequence's {config.seq_len} tokens in 2 x {s.cp} chunks) x " if s.cp > 1 else "")
        + f"tp {s.tp}; "
        f"TP groups inside a node: {'yes' if s.tp <= layout.ranks_per_node else 'NO'}",
        f"  stages       {s.pp * s.virtual} ({s.schedule}, {s.virtual} per rank); blocks per stage "
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
    sequence_parallel = bool(s.strategy.get("sequence_parallel", False))

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
            int(s.strategy.get("zero_stage", 1)),
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
