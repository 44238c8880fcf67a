"""Before launching: does a layout fit, and how fast should it be? Arithmetic only, nothing is allocated.

Model-state bytes follow the ZeRO paper's mixed-precision Adam accounting (MT-NLG: ~20 bytes/parameter:
bf16 weights 2 + bf16 grads 2 + fp32 grads 4 + fp32 master weights 4 + Adam moments 8); activation bytes
follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models").
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.flops import PEAK_BF16_FLOPS, flops_per_iteration

GPU_MEMORY_BYTES = {
    "a100-40g": 40e9,
    "a100-80g": 80e9,
    "a100": 80e9,
    "h100": 80e9,
    "h100-sxm": 80e9,
    "h100-pcie": 80e9,
    "h200": 141e9,
}
RECOMPUTE_MODES = ("none", "selective", "full")

# Bytes per parameter of each model-state component, by precision.
STATE_BYTES = {
    "bf16": {"weights": 2, "grads": 2 + 4, "optimizer": 4 + 4 + 4},  # bf16 grads + fp32 grad accumulation
    "fp32": {"weights": 4, "grads": 4, "optimizer": 4 + 4},  # fp32 training: Adam moments only
}


def params_per_stage(config: ModelConfig, tp: int, pp: int, layers: list[int]) -> list[int]:
    """Parameters held by one TP rank of each pipeline stage (tied embedding counted on first and last stage)."""
    h, f = config.hidden_size, config.ffn_hidden_size
    per_layer_sharded = (3 * h * h + 3 * h + h * h + h * f + f + f * h) // tp
    per_layer_replicated = h + h + 4 * h  # row-parallel biases, 2 LayerNorms (weight + bias)
    per_layer = per_layer_sharded + per_layer_replicated
    vocab = config.padded_vocab_size(tp) * h // tp
    counts = [n * per_layer for n in layers]
    counts[0] += vocab + config.max_position_embeddings * h
    counts[-1] += 2 * h + (vocab if pp > 1 else 0)  # final norm; head copy of the tied embedding
    return counts


def model_state_bytes(params: int, dp: int, zero_stage: int, precision: str = "bf16") -> float:
    b = STATE_BYTES[precision]
    weights, grads, optimizer = (params * b[k] for k in ("weights", "grads", "optimizer"))
    if precision == "fp32" and zero_stage >= 1:
        # DeepSpeed ZeRO keeps an fp32 master partition even for an fp32 model (measured: bench_memory.py);
        # plain DP (ZeRO-0) updates the fp32 weights in place.
        optimizer += params * 4
    if zero_stage >= 1:
        optimizer /= dp
    if zero_stage >= 2:
        grads /= dp
    if zero_stage >= 3:
        weights /= dp
    return weights + grads + optimizer


def activation_bytes_per_layer(
    config: ModelConfig, micro_batch: int, tp: int, recompute: str, seq_len: int | None = None
) -> float:
    """Stored activation bytes of one transformer layer for one micro-batch (bf16, no sequence parallel)."""
    s, b, h, a = seq_len or config.seq_len, micro_batch, config.hidden_size, config.num_heads
    if recompute == "full":
        return 2 * s * b * h  # only the layer input is kept
    if recompute == "selective":
        return s * b * h * (10 + 24 / tp)
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def balanced_layers(num_layers: int, pp: int) -> list[int]:
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i >= pp - extra else 0) for i in range(pp)]


@dataclass
class Plan:
    model: str
    tp: int
    pp: int
    dp: int
    gpus: int
    micro_batch: int
    global_batch: int
    num_microbatches: int
    recompute: str
    zero_stage: int
    layers_per_stage: list[int]
    params_per_gpu: int
    model_state_gb: float
    activation_gb: float
    total_gb: float
    gpu_memory_gb: float
    fits: bool
    tp_within_node: bool
    bubble: float
    flops_per_iteration: float
    iteration_seconds: float
    tflops_per_gpu: float

    def as_dict(self) -> dict:
        return asdict(self)


def plan(
    config: ModelConfig,
    tp: int,
    pp: int,
    dp: int,
    gpus_per_node: int,
    gpu: str,
    global_batch: int,
    micro_batch: int = 1,
    recompute: str = "full",
    zero_stage: int = 1,
    mfu: float = 0.4,
    precision: str = "bf16",
    layers: list[int] | None = None,
) -> Plan:
    gpu = gpu.lower()
    if gpu not in GPU_MEMORY_BYTES:
        raise MTNLGError(f"unknown gpu {gpu!r}; choose one of: {', '.join(GPU_MEMORY_BYTES)}")
    if recompute not in RECOMPUTE_MODES:
        raise MTNLGError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if pp > config.num_layers:
        raise MTNLGError(f"pipeline_parallel {pp} is more stages than the model's {config.num_layers} layers")
    if config.num_heads % tp:
        raise MTNLGError(f"num_heads {config.num_heads} is not divisible by tensor_parallel {tp}")
    if global_batch % (micro_batch * dp):
        raise MTNLGError(f"global batch {global_batch} is not divisible by micro_batch {micro_batch} x dp {dp}")
    layers = layers or balanced_layers(config.num_layers, pp)
    if len(layers) != pp or sum(layers) != config.num_layers:
        raise MTNLGError(f"layers per stage {layers} must be {pp} counts summing to {config.num_layers}")
    num_microbatches = global_batch // (micro_batch * dp)
    stage_params = params_per_stage(config, tp, pp, layers)
    # 1F1B: stage i keeps activations of min(pp - i, m) micro-batches in flight.
    in_flight = [min(pp - i, num_microbatches) for i in range(pp)]
    per_layer = activation_bytes_per_layer(config, micro_batch, tp, recompute)
    s, _h = config.seq_len, config.hidden_size
    # Working set while (re)computing one layer, plus fp32 logits of the last stage.
    working = activation_bytes_per_layer(config, micro_batch, tp, "none") if recompute != "none" else 0
    logits = 4 * s * micro_batch * config.padded_vocab_size(tp) / tp
    totals, activations, states = [], [], []
    for i in range(pp):
        act = per_layer * layers[i] * in_flight[i] + working + (logits if i == pp - 1 else 0)
        state = model_state_bytes(stage_params[i], dp, zero_stage, precision)
        activations.append(act)
        states.append(state)
        totals.append(act + state)
    worst = max(range(pp), key=lambda i: totals[i])
    gpus = tp * pp * dp
    flops = flops_per_iteration(config, global_batch, recompute=recompute == "full")
    peak = PEAK_BF16_FLOPS.get(gpu, PEAK_BF16_FLOPS["a100"])
    model_flops = flops_per_iteration(config, global_batch)
    bubble = (pp - 1) / (num_microbatches + pp - 1)
    # `mfu` is the useful-work efficiency of the busy time; the bubble and recompute add time on top.
    seconds = model_flops / (gpus * peak * mfu) / (1 - bubble) * (flops / model_flops)
    memory = GPU_MEMORY_BYTES[gpu]
    return Plan(
        model=config.name,
        tp=tp,
        pp=pp,
        dp=dp,
        gpus=gpus,
        micro_batch=micro_batch,
        global_batch=global_batch,
        num_microbatches=num_microbatches,
        recompute=recompute,
        zero_stage=zero_stage,
        layers_per_stage=layers,
        params_per_gpu=max(stage_params),
        model_state_gb=states[worst] / 1e9,
        activation_gb=activations[worst] / 1e9,
        total_gb=totals[worst] / 1e9,
        gpu_memory_gb=memory / 1e9,
        fits=totals[worst] <= 0.9 * memory,
        tp_within_node=tp <= gpus_per_node and gpus_per_node % tp == 0,
        bubble=bubble,
        flops_per_iteration=flops,
        iteration_seconds=seconds,
        tflops_per_gpu=flops / seconds / gpus / 1e12,
    )


def tflops_from_time(
    config: ModelConfig, global_batch: int, seconds: float, gpus: int, recompute: bool = True
) -> float:
    """Achieved TFLOP/s per GPU from a measured iteration time (how the paper reports throughput)."""
    return flops_per_iteration(config, global_batch, recompute=recompute) / seconds / gpus / 1e12


def search(
    config: ModelConfig,
    num_gpus: int,
    gpus_per_node: int,
    gpu: str,
    global_batch: int,
    mfu: float = 0.4,
    precision: str = "bf16",
) -> list[Plan]:
    """Every valid (tp, pp, dp, micro batch, recompute, ZeRO) layout that fits, fastest first."""
    plans = []
    tps = [t for t in (1, 2, 4, 8, 16) if t <= gpus_per_node and config.num_heads % t == 0]
    for tp, pp in itertools.product(tps, range(1, config.num_layers + 1)):
        if num_gpus % (tp * pp):
            continue
        dp = num_gpus // (tp * pp)
        for micro, recompute, zero in itertools.product((1, 2, 4), RECOMPUTE_MODES, (0, 1, 2)):
            if global_batch % (micro * dp) or (zero == 2 and pp > 1):
                continue
            candidate = plan(
                config, tp, pp, dp, gpus_per_node, gpu, global_batch, micro, recompute, zero, mfu, precision
            )
            if candidate.fits and candidate.tp_within_node:
                plans.append(candidate)
    return sorted(plans, key=lambda p: (p.iteration_seconds, p.total_gb))


def format_plan(p: Plan) -> str:
    gb = lambda x: f"{x:,.1f} GB"  # noqa: E731
    lines = [
        f"model {p.model}: TP {p.tp} x PP {p.pp} x DP {p.dp} = {p.gpus} GPUs, micro-batch {p.micro_batch}, "
        f"global batch {p.global_batch} ({p.num_microbatches} micro-batches per pipeline)",
        f"  layers per stage     {p.layers_per_stage if len(set(p.layers_per_stage)) > 1 else p.layers_per_stage[0]}",
        f"  params per GPU       {p.params_per_gpu / 1e9:,.3f} B (largest stage)",
        f"  model states         {gb(p.model_state_gb)} (ZeRO-{p.zero_stage})",
        f"  activations          {gb(p.activation_gb)} (recompute: {p.recompute}, 1F1B in-flight micro-batches)",
        f"  total / GPU memory   {gb(p.total_gb)} / {gb(p.gpu_memory_gb)} -> {'fits' if p.fits else 'DOES NOT FIT'}"
        f" (90% budget)",
        f"  TP inside a node     {'yes' if p.tp_within_node else 'NO: TP all-reduces would cross nodes'}",
        f"  pipeline bubble      {p.bubble:.1%} = (PP-1)/(m+PP-1)",
        f"  FLOPs per iteration  {p.flops_per_iteration:.3e} ({'with' if p.recompute == 'full' else 'without'} "
        f"full-recompute FLOPs)",
        f"  iteration time       {p.iteration_seconds:,.1f} s -> {p.tflops_per_gpu:,.0f} TFLOP/s per GPU",
    ]
    return "\n".join(lines)
