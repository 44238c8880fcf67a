"""Planner: does a (TP, CP, PP, DP) layout fit, how long is an iteration, and why? Or: which layout is fastest?

Check one layout (memory per GPU, time per iteration with its breakdown):
    mtnlg-plan --model mtnlg-530b --tp 8 --pp 35 --dp 16 --gpu a100-80g --global-batch 1920 \\
        --micro-batch 1 --recompute full --rampup 32 32 5859375
The layout of a strategy file, checked as `mtnlg fit` checks it, on a cluster of --gpus:
    mtnlg-plan --model gpt3-1.3b --strategy configs/strategy/tp2_pp2_dp2.yaml --gpus 16 --global-batch 512
Rank every layout of a cluster that fits, and explain the top ones; write the best as a strategy config:
    mtnlg-plan --model gpt3-1.3b --gpus 16 --global-batch 512 --search --write-config best.yaml
    mtnlg fit --config my_run.yaml --trainer.strategy best.yaml --model.micro_batch_size ... (printed)
Long sequences: which context-parallel layouts fit Llama 3.1 8B at 128k tokens on 64 H200:
    mtnlg-plan --model llama3.1-8b --seq 131072 --gpus 64 --gpu h200 --global-batch 64 --search
LoRA fine-tuning of Llama 3.1 8B (frozen base: weights only; the adapters' gradients and optimizer state):
    mtnlg-plan --model llama3.1-8b --seq 4096 --tp 2 --pp 1 --dp 4 --gpu h100 --global-batch 64 \\
        --lora '{rank: 16, alpha: 32, targets: [q_proj, v_proj]}'
GRPO of Qwen3 8B, 16 prompts a step x 8 completions of up to 256 tokens (the generation's KV cache and time):
    mtnlg-plan --model qwen3-8b --seq 1024 --tp 2 --pp 1 --dp 4 --zero-stage 2 --gpu h100 --global-batch 16 \\
        --grpo '{num_generations: 8, max_completion_length: 256, beta: 0.0}'
A model by its dimensions instead of a preset:
    mtnlg-plan --layers 48 --hidden 6144 --heads 64 --seq 2048 --vocab 51200 --gpus 64 --search
How many GPUs to evaluate or generate with a model (weights + KV cache of a batch; smallest TP x PP per GPU kind):
    mtnlg-plan --inference --model mtnlg-530b --gpu a100-80g,h200 --batch 1 --length 2048

The time model (src/mtnlg_lightning/planning/cost_model.py) is checked against published runs:
mtnlg-validate-planner prints predicted vs published throughput.
"""

import argparse
import json
import sys
from pathlib import Path

from mtnlg_lightning.config import PRESETS, ModelConfig, get_config
from mtnlg_lightning.errors import MTNLGError, run_main
from mtnlg_lightning.gpus import GPUS, get_gpu, gpu_names, load_gpu_specs
from mtnlg_lightning.outputs import atomic_write
from mtnlg_lightning.parallel.config import STRATEGY_PATHS, ParallelConfig, read_strategy_file
from mtnlg_lightning.planning.cost_model import IMPLEMENTATIONS
from mtnlg_lightning.planning.dpo_plan import REFERENCES, preference_plan
from mtnlg_lightning.planning.grpo_plan import ONE_OBJECTIVE, parse_grpo
from mtnlg_lightning.planning.inference_plan import inference_report, smallest_layouts
from mtnlg_lightning.planning.lora_plan import parse_lora
from mtnlg_lightning.planning.muon_plan import MuonPlan
from mtnlg_lightning.planning.planner import RECOMPUTE_MODES, Plan, format_breakdown, format_plan, plan, search

DIMENSIONS = {
    "layers": "num_layers",
    "hidden": "hidden_size",
    "heads": "num_heads",
    "seq": "seq_len",
    "vocab": "vocab_size",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtnlg-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model = parser.add_argument_group("model (a preset, optionally with dimensions overridden)")
    model.add_argument("--model", default=None, help=f"preset: {', '.join(PRESETS)} (default mtnlg-530b)")
    for flag, field in DIMENSIONS.items():
        model.add_argument(f"--{flag}", type=int, help=f"{field} (overrides the preset's)")
    model.add_argument(
        "--mtp-layers",
        type=int,
        help="multi-token prediction depths trained beside the model (model.mtp_layers; DeepSeek-V3 trained 1)",
    )
    hardware = parser.add_argument_group("hardware")
    hardware.add_argument(
        "--gpu",
        default=None,
        help=f"GPU type: {', '.join(gpu_names())} (default a100-80g; with --inference a comma-separated list, "
        f"default every kind)",
    )
    hardware.add_argument("--gpu-spec", help="YAML file adding GPU types (fields of gpus.GPUSpec)")
    hardware.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node: the NVLink domain (default 8)")
    hardware.add_argument(
        "--gpus", type=int, help="cluster size (default: tp x cp x pp x dp); checking one layout, DP is what is left"
    )
    layout = parser.add_argument_group(
        "layout (checked as the trainer checks it; with --search only the batch, precision and implementation apply, "
        "and tp x cp x pp x dp is the default --gpus)"
    )
    layout.add_argument(
        "--strategy",
        metavar="FILE",
        help="a strategy YAML (configs/strategy/*.yaml, a --write-config output): its layout replaces --tp, --pp, "
        "--cp, --ep, --virtual-stages, --sequence-parallel and --zero-stage",
    )
    layout.add_argument("--tp", type=int, default=8, help="tensor-parallel size, inside a node (default 8)")
    layout.add_argument("--pp", type=int, default=35, help="pipeline-parallel stages (default 35)")
    layout.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    layout.add_argument(
        "--cp", type=int, default=1, help="context-parallel ranks per sequence (default 1; seq divisible by 2 x cp)"
    )
    experts = "a mixture-of-experts model's experts split over this many of the dp ranks (divides --dp and them)"
    layout.add_argument("--ep", type=int, default=1, help=f"expert-parallel size: {experts} (default 1)")
    layout.add_argument("--virtual-stages", type=int, default=1, help="model chunks per GPU (interleaved 1F1B)")
    layout.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    layout.add_argument("--global-batch", type=int, default=1920, help="sequences per iteration (default 1920)")
    layout.add_argument("--recompute", default="full", choices=RECOMPUTE_MODES, help="activation recomputation")
    layout.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (TP > 1)")
    layout.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3), help="ZeRO stage over DP")
    layout.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="training precision")
    layout.add_argument(
        "--optimizer",
        default="adamw",
        choices=("adamw", "muon"),
        help="--model.optimizer: muon keeps one momentum buffer for the hidden matrices and adds Newton-Schulz "
        "FLOPs and communication to the step (one layout, any --zero-stage)",
    )
    layout.add_argument(
        "--rampup",
        type=int,
        nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="batch ramp-up (as --model.rampup_batch_size) to time: its steps and hours",
    )
    layout.add_argument(
        "--implementation",
        default="mtnlg-lightning",
        choices=sorted(IMPLEMENTATIONS),
        help="training software whose fusions/overlaps to model (default: this trainer)",
    )
    layout.add_argument(
        "--lora",
        metavar="YAML",
        help="size LoRA fine-tuning instead of full fine-tuning, settings as --model.lora takes them, e.g. "
        "'{rank: 16, alpha: 32, targets: [q_proj, v_proj]}' (default targets: every attention and MLP projection): "
        "the base is frozen (weights only), the adapters hold gradients and optimizer state",
    )
    layout.add_argument(
        "--dpo",
        choices=REFERENCES,
        metavar="REFERENCE",
        help="size preference tuning (--model.objective dpo): batches count pairs, two sequences each; each step "
        "adds the reference's forward pass. REFERENCE for full weights: 'copy' (a frozen copy of each GPU's weights, "
        "not under ZeRO-3) or 'precomputed' (data.precompute_reference: no copy, no reference pass per step); "
        "with --lora the reference is the base with the adapters off",
    )
    layout.add_argument(
        "--grpo",
        metavar="YAML",
        help="size GRPO (--model.objective grpo), settings as --model.grpo takes them, e.g. '{num_generations: 8, "
        "max_completion_length: 256, beta: 0.0}' (TRL's defaults for keys left out): --global-batch counts prompts, "
        "each trained as num_generations sequences of --seq; each step first generates them: the KV cache of a "
        "GPU's sequences beside the model states (prompts of up to seq - max_completion_length tokens), the prefill "
        "and the memory-bound decode of max_completion_length tokens beside the training time (under ZeRO-3 the "
        "weights gathered whole while generating; under --cp each rank decodes whole rows); beta > 0 adds the "
        "reference's forward pass (and a frozen copy of the weights without --lora); num_iterations mu > 1 spreads "
        "a generation and its forwards over mu steps. Not with --dpo, a frozen copy under ZeRO-3, or "
        "num_iterations > 1 with --rampup (as the trainer)",
    )
    infer = parser.add_argument_group("inference: how many GPUs to evaluate or generate with the model")
    infer.add_argument(
        "--inference",
        action="store_true",
        help="print the smallest TP x PP per GPU kind that holds the weights, the KV cache of --batch x --length "
        "tokens and the working set (no training state); the training layout flags are ignored",
    )
    infer.add_argument("--batch", type=int, default=1, help="sequences evaluated or generated at once (default 1)")
    infer.add_argument("--length", type=int, help="tokens per sequence, prompt + generated (default: seq_len)")
    infer.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="weights and KV cache dtype")
    out = parser.add_argument_group("output")
    out.add_argument("--search", action="store_true", help="rank every layout that fits, fastest first")
    out.add_argument("--top", type=int, default=10, help="layouts listed by --search (default 10)")
    out.add_argument("--explain", type=int, default=3, help="layouts whose time breakdown --search prints")
    out.add_argument("--write-config", metavar="PATH", help="write the (best) layout as a strategy YAML")
    out.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def model_config(args) -> ModelConfig:
    overrides = {field: getattr(args, flag) for flag, field in DIMENSIONS.items() if getattr(args, flag) is not None}
    depths = {"mtp_layers": args.mtp_layers} if getattr(args, "mtp_layers", None) is not None else {}
    if args.model is None and overrides:
        missing = [f"--{flag}" for flag in ("layers", "hidden", "heads", "seq") if getattr(args, flag) is None]
        if missing:
            raise MTNLGError(f"a model by dimensions needs {', '.join(missing)} (or --model PRESET to start from)")
        return ModelConfig(**overrides, **depths, name="custom")
    preset = args.model or "mtnlg-530b"
    if "seq_len" in overrides:
        overrides.setdefault("max_position_embeddings", overrides["seq_len"])
    return get_config(preset, **overrides, **depths)


def strategy_yaml(p: Plan, gpus_per_node: int) -> str:
    schedule = planned_config(p.tp, p.pp, p.cp, p.virtual_stages, p.zero_stage, p.sequence_parallel, p.ep)
    schedule = schedule.pipeline_schedule
    lines = [
        f"# Written by mtnlg-plan: {p.model} on {p.gpus} x {p.gpu}, global batch {p.global_batch}; predicted "
        f"{p.iteration_seconds:.3g} s per iteration (MFU {p.mfu:.0%}), {p.total_gb:.1f} GB per GPU.",
        f"#   mtnlg fit --config YOUR_RUN.yaml --trainer.strategy THIS_FILE --model.micro_batch_size {p.micro_batch} "
        f"--model.global_batch_size {p.global_batch}",
        f"class_path: {STRATEGY_PATHS[0]}",
        "init_args:",
        f"  tensor_parallel: {p.tp}",
        f"  pipeline_parallel: {p.pp}",
        f"  pipeline_schedule: {schedule}",
        f"  virtual_pipeline_stages: {p.virtual_stages}",
        f"  zero_stage: {p.zero_stage}",
        f"  gpus_per_node: {gpus_per_node}",
    ]
    if p.sequence_parallel:
        lines.append("  sequence_parallel: true")
    if p.cp > 1:
        lines.append(f"  context_parallel: {p.cp}")
    if p.ep > 1:
        lines.append(f"  expert_parallel: {p.ep}")
    return "\n".join(lines) + "\n"


def write_config(path: str, p: Plan, gpus_per_node: int) -> None:
    """Atomic: a temp file in the target folder, renamed over the target."""
    target = Path(path)
    if not target.parent.is_dir():
        raise MTNLGError(f"--write-config: folder {target.parent} does not exist")
    with atomic_write(target, "w") as f:
        f.write(strategy_yaml(p, gpus_per_node))


def usage_lines(path: str, p: Plan, gpus_per_node: int) -> list[str]:
    lines = [
        f"wrote {path}; train with:",
        f"  mtnlg fit --config YOUR_RUN.yaml --trainer.strategy {path} --model.micro_batch_size {p.micro_batch} "
        f"--model.global_batch_size {p.global_batch} --trainer.devices {min(p.gpus, gpus_per_node)} "
        f"--trainer.num_nodes {max(1, p.gpus // gpus_per_node)}",
    ]
    if p.recompute != "none":
        lines.append(
            f"  with recompute: --trainer.callbacks+=callbacks/activation_checkpointing.yaml "
            f"--trainer.callbacks.init_args.mode {p.recompute}"
        )
    return lines


def print_search(plans: list[Plan], args, gpus: int, name: str) -> None:
    print(
        f"{len(plans)} layouts of {gpus} x {args.gpu} fit {name} (global batch {args.global_batch}); "
        f"fastest {args.top}:"
    )
    print(
        f"{'#':>3} {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>5} {'ep':>3} {'v':>2} {'mb':>3} {'recompute':>9} {'sp':>3} "
        f"{'zero':>4} "
        f"{'GB/GPU':>7} {'bubble':>7} {'s/iter':>8} {'TFLOP/s':>8} {'MFU':>6}"
    )
    for i, p in enumerate(plans[: args.top], start=1):
        print(
            f"{i:>3} {p.tp:>3} {p.cp:>3} {p.pp:>3} {p.dp:>5} {p.ep:>3} {p.virtual_stages:>2} {p.micro_batch:>3} "
            f"{p.recompute:>9} "
            f"{'yes' if p.sequence_parallel else 'no':>3} {p.zero_stage:>4} {p.total_gb:>7.1f} {p.bubble:>7.1%} "
            f"{p.iteration_seconds:>8.3f} {p.tflops_per_gpu:>8.1f} {p.mfu:>6.1%}"
        )
    if plans and args.explain:
        print("why (time per iteration on the slowest pipeline stage):")
        for i, p in enumerate(plans[: args.explain], start=1):
            print(f"  #{i}: {format_breakdown(p)}")


def print_inference(args, config: ModelConfig, extra) -> None:
    names = args.gpu.split(",") if args.gpu else sorted({**GPUS, **(extra or {})})
    specs = {name: get_gpu(name, extra) for name in names}  # every name checked before any output
    if args.json:
        found = {
            name: [
                {**p.as_dict(), "gpu": name}
                for p in smallest_layouts(config, spec, args.batch, args.length, args.dtype, args.gpus_per_node)
            ]
            for name, spec in specs.items()
        }
        print(json.dumps(found, indent=1))
    else:
        print(inference_report(config, names, args.batch, args.length, args.dtype, args.gpus_per_node, extra))


def planned_config(tp: int, pp: int, cp: int, virtual: int, zero_stage: int, sp: bool, ep: int = 1) -> ParallelConfig:
    """A layout as the planner models it: interleaved 1F1B when a rank holds several stages (as written by
    --write-config)."""
    return ParallelConfig(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        pipeline_schedule="interleaved_1f1b" if virtual > 1 else "1f1b",
        virtual_pipeline_stages=virtual,
        zero_stage=zero_stage,
        sequence_parallel=sp,
        context_parallel=cp,
        expert_parallel=ep,
    )


def parallel_config(args) -> ParallelConfig:
    """The layout to check: the strategy file's, read as the trainer reads it, else the layout flags'."""
    if args.strategy:
        return read_strategy_file(args.strategy)
    return planned_config(
        args.tp, args.pp, args.cp, args.virtual_stages, args.zero_stage, args.sequence_parallel, args.ep
    )


def plan_layout(args, config: ModelConfig, gpu, lora=None, grpo=None) -> Plan:
    """One layout, first validated as the trainer validates it (`ParallelConfig.validate`), then planned."""
    parallel = parallel_config(args)
    world = args.gpus or parallel.tensor_parallel * parallel.context_parallel * parallel.pipeline_parallel * args.dp
    layout = parallel.validate(config, world, gpus_per_node=args.gpus_per_node)
    explicit = parallel.first_stage_layers is not None or parallel.last_stage_layers is not None
    layers = parallel.stage_layers(config.num_layers) if explicit and parallel.virtual_pipeline_stages == 1 else None
    dpo = preference_plan(args.dpo, lora is not None, parallel.zero_stage) if args.dpo else None
    return plan(
        config, layout.tensor_parallel, layout.pipeline_parallel, layout.data_parallel, layout.ranks_per_node, gpu,
        args.global_batch, args.micro_batch, args.recompute, parallel.zero_stage, precision=args.precision,
        layers=layers, virtual_stages=parallel.virtual_pipeline_stages, sequence_parallel=parallel.sequence_parallel,
        implementation=args.implementation, rampup=args.rampup, cp=layout.context_parallel, lora=lora, dpo=dpo,
        ep=layout.expert_parallel, grpo=grpo, muon=MuonPlan() if args.optimizer == "muon" else None,
    )  # fmt: skip


def trainer_runs(p: Plan, config: ModelConfig, gpus_per_node: int) -> bool:
    """Whether the trainer accepts a searched layout (`ParallelConfig.validate`)."""
    parallel = planned_config(p.tp, p.pp, p.cp, p.virtual_stages, p.zero_stage, p.sequence_parallel, p.ep)
    try:
        parallel.validate(config, p.gpus, gpus_per_node=gpus_per_node)
    except MTNLGError:
        return False
    return True


def run(args) -> None:
    config = model_config(args)
    extra = load_gpu_specs(args.gpu_spec) if args.gpu_spec else None
    if args.inference:
        print_inference(args, config, extra)
        return
    args.gpu = args.gpu or "a100-80g"
    gpu = get_gpu(args.gpu, extra)
    lora = parse_lora(args.lora, config) if args.lora is not None else None
    if args.dpo and args.grpo is not None:
        raise MTNLGError(ONE_OBJECTIVE)
    grpo = parse_grpo(args.grpo, config, lora is not None) if args.grpo is not None else None
    if args.search and args.optimizer != "adamw":
        raise MTNLGError("--optimizer muon plans one layout: give it with --tp/--pp/--dp and --zero-stage")
    if args.search:
        gpus = args.gpus or args.tp * args.cp * args.pp * args.dp
        ParallelConfig().layout(gpus, args.gpus_per_node)  # a cluster of whole nodes
        plans = search(
            config, gpus, args.gpus_per_node, gpu, args.global_batch, args.precision, args.implementation, lora=lora,
            dpo_reference=args.dpo, grpo=grpo,
        )  # fmt: skip
        plans = [p for p in plans if trainer_runs(p, config, args.gpus_per_node)]
        for p in plans:
            p.gpu = args.gpu
        if not plans:
            raise MTNLGError(
                f"no layout of {gpus} x {args.gpu} fits {config.name} at global batch {args.global_batch} "
                f"(is the batch divisible by data-parallel sizes? is memory enough?)"
            )
        chosen = plans[0]
        if args.json:
            print(json.dumps([p.as_dict() for p in plans[: args.top]], indent=1))
        else:
            print_search(plans, args, gpus, config.name)
    else:
        chosen = plan_layout(args, config, gpu, lora, grpo)
        chosen.gpu = args.gpu
        print(json.dumps(chosen.as_dict(), indent=1) if args.json else format_plan(chosen))
    if args.write_config:
        write_config(args.write_config, chosen, args.gpus_per_node)
        if not args.json:
            print("\n".join(usage_lines(args.write_config, chosen, args.gpus_per_node)))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_main("mtnlg-plan", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
