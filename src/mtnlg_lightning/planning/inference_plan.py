"""How many GPUs to evaluate or sample from a model: per GPU, the weights of its stage's TP shard, the KV cache of a
batch of `length` tokens, one layer's forward working set and the last stage's logits; the smallest TP x PP that
fits, per GPU kind. Arithmetic only, nothing is allocated.

No gradients, optimizer states or stored activations: inference keeps the weights (bf16 by default: 2 bytes per
parameter, 1.06 TB for MT-NLG 530B), keys and values of every layer for every token of the batch (2 x layers x
batch x length x hidden values, split over TP by heads and over PP by layers), the activations of the one layer being
computed (Korthikanti et al.'s per-layer count without the attention-score term: fused attention keeps no scores),
and on the last stage the fp32 logits of the scored positions (vocabulary split over TP).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.gpus import GPUSpec, get_gpu
from mtnlg_lightning.planning.activations import DTYPE_BYTES, forward_working_bytes, kv_cache_bytes
from mtnlg_lightning.planning.planner import MEMORY_BUDGET, params_per_stage

TP_DEGREES = (1, 2, 4, 8, 16)


@dataclass
class InferencePlan:
    model: str
    gpu: str
    tp: int
    pp: int
    gpus: int
    batch: int
    length: int
    dtype: str
    layers_per_stage: list[int]
    weights_gb: float  # of the fullest stage's GPU, as are the figures below
    kv_cache_gb: float
    working_gb: float
    total_gb: float
    gpu_memory_gb: float
    fits: bool

    def as_dict(self) -> dict:
        return asdict(self)


def inference_plan(
    config: ModelConfig,
    tp: int,
    pp: int,
    gpu: str | GPUSpec,
    batch: int = 1,
    length: int | None = None,
    dtype: str = "bf16",
) -> InferencePlan:
    """Memory per GPU of evaluating or generating with `config` in TP x PP (DP replicas only multiply it)."""
    # parallel/pipeline.py imports torch (seconds); the planner (mtnlg-plan) answers without it.
    from mtnlg_lightning.parallel.pipeline import layers_per_stage

    spec = gpu if isinstance(gpu, GPUSpec) else get_gpu(gpu)
    length = length or config.seq_len
    if dtype not in DTYPE_BYTES:
        raise MTNLGError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if min(tp, pp, batch, length) < 1:
        raise MTNLGError(f"tp {tp}, pp {pp}, batch {batch} and length {length} must be >= 1")
    if config.num_heads % tp:
        raise MTNLGError(f"num_heads {config.num_heads} is not divisible by tensor_parallel {tp}")
    if length > config.max_position_embeddings:
        raise MTNLGError(f"length {length} is above the model's {config.max_position_embeddings} positions")
    layers = layers_per_stage(config.num_layers, pp)  # the split `--strategy` runs (first/last stages lighter)
    width = DTYPE_BYTES[dtype]
    stage_params = params_per_stage(config, tp, pp, layers)
    working, logits = forward_working_bytes(config, batch, length, tp, width)
    stages = []
    for i, n in enumerate(layers):
        weights = stage_params[i] * width
        kv = kv_cache_bytes(config, n, batch, length, tp, dtype)
        work = working + (logits if i == pp - 1 else 0)
        stages.append((weights + kv + work, weights, kv, work))
    total, weights, kv, work = max(stages)
    return InferencePlan(
        model=config.name,
        gpu=gpu if isinstance(gpu, str) else "custom",
        tp=tp,
        pp=pp,
        gpus=tp * pp,
        batch=batch,
        length=length,
        dtype=dtype,
        layers_per_stage=layers,
        weights_gb=weights / 1e9,
        kv_cache_gb=kv / 1e9,
        working_gb=work / 1e9,
        total_gb=total / 1e9,
        gpu_memory_gb=spec.memory_gb,
        fits=total <= MEMORY_BUDGET * spec.memory_gb * 1e9,
    )


def smallest_layouts(
    config: ModelConfig,
    gpu: str | GPUSpec,
    batch: int = 1,
    length: int | None = None,
    dtype: str = "bf16",
    gpus_per_node: int = 8,
) -> list[InferencePlan]:
    """For each TP degree inside a node (dividing the heads), the fewest pipeline stages that fit; fewest GPUs
    first, and among equal counts the larger TP (fewer stages: less latency per token)."""
    found = []
    for tp in TP_DEGREES:
        if tp > gpus_per_node or gpus_per_node % tp or config.num_heads % tp:
            continue
        for pp in range(1, config.num_layers + 1):
            candidate = inference_plan(config, tp, pp, gpu, batch, length, dtype)
            if candidate.fits:
                found.append(candidate)
                break
    return sorted(found, key=lambda p: (p.gpus, -p.tp))


def format_smallest(gpu: str, plans: list[InferencePlan]) -> str:
    """One line per GPU kind: the smallest layout, with the others that fit at each TP degree."""
    if not plans:
        return f"  {gpu:<10} nothing fits: even one layer per stage is over {MEMORY_BUDGET:.0%} of its memory"
    best = plans[0]
    others = ", ".join(f"tp{p.tp} x pp{p.pp} ({p.gpus})" for p in plans[1:])
    count = f"{best.gpus} GPU{'s' if best.gpus > 1 else ''}"
    return (
        f"  {gpu:<10} tp{best.tp} x pp{best.pp} = {count}: {best.total_gb:,.1f} of {best.gpu_memory_gb:,.0f}"
        f" GB on the fullest GPU (weights {best.weights_gb:,.1f}, KV cache {best.kv_cache_gb:,.2f}, working "
        f"{best.working_gb:,.2f})" + (f"; also {others}" if others else "")
    )


def inference_report(
    config: ModelConfig,
    gpus: list[str],
    batch: int,
    length: int | None,
    dtype: str = "bf16",
    gpus_per_node: int = 8,
    extra: dict[str, GPUSpec] | None = None,
) -> str:
    """The smallest layouts of each GPU kind in `gpus` (names; `extra`: kinds from a --gpu-spec file), as text."""
    length = length or config.seq_len
    lines = [
        f"to evaluate or generate with {config.name} ({dtype} weights, KV cache of {batch} x {length} tokens), the "
        f"smallest TP x PP per GPU kind ({MEMORY_BUDGET:.0%} of memory; data-parallel replicas multiply it):"
    ]
    for name in gpus:
        plans = smallest_layouts(config, get_gpu(name, extra), batch, length, dtype, gpus_per_node)
        lines.append(format_smallest(name, plans))
    return "\n".join(lines)
