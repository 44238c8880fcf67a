"""Validate a `mtnlg fit` config for a cluster we do not have: layout, per-stage meta models, batches, memory."""

from __future__ import annotations

import inspect
from pathlib import Path

import yaml

from mtnlg_lightning.config import count_parameters, deep_merge, get_config
from mtnlg_lightning.errors import MTNLGError
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


def dry_run(config_paths: list[str], gpu: str = "a100-80g", recompute: str | None = None) -> str:
    config = load_configs(config_paths)
    trainer, model_args = config.get("trainer") or {}, config.get("model") or {}
    strategy = _init_args(trainer.get("strategy"), str(trainer.get("strategy")))
    # The module and the strategy import Lightning (seconds): a config that fails to load is reported first.
    from mtnlg_lightning.train.module import MTNLGModule
    from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy

    _check_keys(strategy, MegatronDeepSpeedStrategy, "trainer.strategy.init_args")
    _check_keys(model_args, MTNLGModule, "model")
    nodes, devices = int(trainer.get("num_nodes", 1)), trainer.get("devices", 1)
    if not isinstance(devices, int):
        raise MTNLGError(f"trainer.devices must be a number of devices per node for a dry run, got {devices!r}")
    world = nodes * devices
    tp, pp = int(strategy.get("tensor_parallel", 1)), int(strategy.get("pipeline_parallel", 1))
    cp = int(strategy.get("context_parallel", 1))
    schedule = strategy.get("pipeline_schedule", "1f1b")
    virtual = strategy.get("virtual_pipeline_stages") or (2 if schedule in MULTI_STAGE else 1)
    gpus_per_node, across = strategy.get("gpus_per_node") or devices, bool(strategy.get("allow_tp_across_nodes", False))
    layout = ParallelLayout(world, tp, pp, gpus_per_node, across, cp)
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
    first_batch = batches.batch_size(0)
    micro_first, micro_full = (b // (micro * layout.data_parallel) for b in (first_batch, batches.global_batch_size))

    # Every distinct stage on the meta device, TP-sharded as one TP rank holds it: real module code, no memory.
    # With one stage per rank and equal middle stages, the first, one middle and the last rank are all the kinds.
    uniform_middle = virtual == 1 and len(set(counts[1:-1])) <= 1
    ranks = sorted({0, min(1, pp - 1), pp - 1}) if uniform_middle else list(range(pp))
    params_of = {r: _stage_parameters(model_config, pp, r, schedule, virtual, strategy, tp) for r in ranks}
    params_per_stage = [params_of.get(r, params_of.get(min(1, pp - 1))) for r in range(pp)]

    callbacks = trainer.get("callbacks") or []
    modes = [
        (c.get("init_args") or {}).get("mode")
        for c in callbacks
        if isinstance(c, dict) and c.get("class_path", "").endswith("ActivationCheckpointing")
    ]
    recompute = recompute or (modes[0] if modes and modes[0] in ("full", "selective") else "none")
    sequence_parallel = bool(strategy.get("sequence_parallel", False))

    def estimate_with(sp: bool):
        return plan(
            model_config,
            tp,
            pp,
            layout.data_parallel,
            layout.ranks_per_node,
            gpu,
            batches.global_batch_size,
            micro,
            recompute,
            int(strategy.get("zero_stage", 1)),
            layers=counts if virtual == 1 else None,
            virtual_stages=virtual,
            sequence_parallel=sp,
            cp=cp,
        )

    estimate = estimate_with(sequence_parallel)
    # Sequence parallelism shards the LayerNorm/dropout/residual activations over TP (Korthikanti et al. 2022):
    # show the memory per GPU both ways so the choice is visible.
    sp_lines = []
    if tp > 1 and (model_config.seq_len // cp) % tp == 0:
        without, with_sp = estimate_with(False), estimate_with(True)
        sp_lines.append(
            f"  sequence par. memory per GPU without SP {without.total_gb:,.1f} GB (activations "
            f"{without.activation_gb:,.1f} GB), with SP {with_sp.total_gb:,.1f} GB (activations "
            f"{with_sp.activation_gb:,.1f} GB); this config: SP {'on' if sequence_parallel else 'off'}"
        )

    total_params = count_parameters(model_config)
    lines = [
        f"dry run of {', '.join(config_paths)}: OK",
        f"  model        {model_config.name}: {model_config.num_layers} layers, hidden {model_config.hidden_size}, "
        f"{model_config.num_heads} heads, seq {model_config.seq_len}, vocab {model_config.vocab_size} -> "
        f"{model_config.padded_vocab_size(tp)} padded; {total_params / 1e9:,.1f}B parameters",
        f"  layout       world {world} = {nodes} node(s) x {devices}: pp {pp} x dp {layout.data_parallel} x "
        + (f"cp {cp} (each sequence's {model_config.seq_len} tokens in 2 x {cp} chunks) x " if cp > 1 else "")
        + f"tp {tp}; "
        f"TP groups inside a node: {'yes' if tp <= layout.ranks_per_node else 'NO'}",
        f"  stages       {pp * virtual} ({schedule}, {virtual} per rank); blocks per stage "
        f"{counts[0] if len(set(counts)) == 1 else counts}",
        f"  params/GPU   first {params_per_stage[0] / 1e9:.3f}B, middle "
        f"{params_per_stage[len(params_per_stage) // 2] / 1e9:.3f}B, last {params_per_stage[-1] / 1e9:.3f}B "
        f"(built on the meta device, TP-sharded)",
        f"  batches      {first_batch} -> {batches.global_batch_size} sequences (ramp over {batches.rampup_samples:,} "
        f"samples, {batches.steps_for_samples(batches.rampup_samples):,} steps); micro-batches per pipeline "
        f"{micro_first} -> {micro_full}"
        + ("  (fewer than the stages early in the ramp: run as GPipe order)" if micro_first < pp * virtual else ""),
        format_plan(estimate),
        *sp_lines,
        _inference_lines(model_config, gpu, micro, layout.ranks_per_node),
    ]
    return "\n".join(lines)


def _inference_lines(model_config, gpu: str, micro: int, gpus_per_node: int) -> str:
    """After training: how many GPUs evaluating this model takes, on this config's GPU first, then the others."""
    chosen = ALIASES.get(gpu.lower(), gpu.lower())
    kinds = [chosen] + sorted(name for name in GPUS if name != chosen)
    return inference_report(model_config, kinds, micro, None, "bf16", gpus_per_node)
