"""Before launching: does a layout fit, how long is an iteration and why? Arithmetic only, nothing is allocated.

Model-state bytes follow the ZeRO paper's mixed-precision Adam accounting (MT-NLG: ~20 bytes/parameter:
bf16 weights 2 + bf16 grads 2 + fp32 grads 4 + fp32 master weights 4 + Adam moments 8); activation bytes
(`activations`) follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
with and without sequence parallelism. Time comes from `cost_model.iteration_breakdown`.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from functools import partial

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import (
    active_parameters,
    expert_parameters_per_layer,
    mtp_parameters,
    parameters_per_rank,
)
from mtnlg_lightning.gpus import GPUSpec, get_gpu
from mtnlg_lightning.parallel.lora import LoRAConfig
from mtnlg_lightning.planning.activations import activation_bytes_per_layer
from mtnlg_lightning.planning.cost_model import (
    IMPLEMENTATIONS,
    Implementation,
    Layout,
    all_gather_seconds,
    dp_bandwidth,
    iteration_breakdown,
)
from mtnlg_lightning.planning.dpo_plan import PreferencePlan, format_dpo, preference_plan
from mtnlg_lightning.planning.grpo_plan import ONE_OBJECTIVE, GRPOPlan, format_grpo
from mtnlg_lightning.planning.lora_plan import format_lora, lora_summary, stage_state
from mtnlg_lightning.planning.muon_plan import MuonPlan, format_muon
from mtnlg_lightning.train.flops import flops_per_iteration
from mtnlg_lightning.train.lr_batch_schedules import BatchSizeSchedule

RECOMPUTE_MODES = ("none", "selective", "full")
MEMORY_BUDGET = 0.9  # of the GPU's memory: allocator fragmentation, NCCL buffers, CUDA context

# Bytes per parameter of each model-state component, by precision.
STATE_BYTES = {
    "bf16": {"weights": 2, "grads": 2 + 4, "optimizer": 4 + 4 + 4},  # bf16 grads + fp32 grad accumulation
    "fp32": {"weights": 4, "grads": 4, "optimizer": 4 + 4},  # fp32 training: Adam moments only
}


def params_per_stage(config: ModelConfig, tp: int, pp: int, layers: list[int], ep: int = 1) -> list[int]:
    """Parameters held by one TP rank of each pipeline stage, from the family spec (`families.parameters_per_rank`:
    each module as the tensor-parallel plan holds it): the blocks (a mixture of experts' experts divided by `ep`),
    the word embedding and learned positions on the first stage, the final norm and the LM head on the last (a tied
    head counted there too when pipelined: the last stage holds its copy)."""
    blocks, top = parameters_per_rank(config, tp)
    experts = expert_parameters_per_layer(config)
    held = [n - e + e // ep for n, e in zip(blocks, experts, strict=True)]
    counts = _per_stage(held, layers)
    word_embedding = top["embed.wte"]
    counts[0] += word_embedding + top.get("embed.wpe", 0)
    head = top["lm_head"] if (pp > 1 or not config.tie_embeddings) else 0
    counts[-1] += top["norm"] + head
    # the multi-token prediction depths, on the last stage (with a copy of the word embedding when pipelined and
    # the head is untied: a tied head's copy serves them)
    if config.mtp_layers:
        copy = word_embedding if pp > 1 and not config.tie_embeddings else 0
        counts[-1] += mtp_parameters(config, tp, ep) + copy
    return counts


def expert_params_per_stage(config: ModelConfig, layers: list[int], ep: int = 1) -> list[int]:
    """Of `params_per_stage`, the experts' parameters one rank of each stage holds (E / ep of each MoE layer's, the
    multi-token prediction depths' on the last stage)."""
    per_layer = [e // ep for e in expert_parameters_per_layer(config)]
    counts = _per_stage(per_layer, layers)
    counts[-1] += config.mtp_layers * per_layer[-1]
    return counts


def _per_stage(per_layer: list[int], layers: list[int]) -> list[int]:
    ends = list(itertools.accumulate(layers))
    return [sum(per_layer[end - n : end]) for n, end in zip(layers, ends, strict=True)]


def model_state_bytes(params: int, dp: int, zero_stage: int, precision: str = "bf16") -> float:
    return sum(model_state_parts(params, dp, zero_stage, precision))


def model_state_parts(params: int, dp: int, zero_stage: int, precision: str = "bf16") -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of `params` trained parameters on one GPU."""
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
    return weights, grads, optimizer


def balanced_layers(num_layers: int, pp: int) -> list[int]:
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i >= pp - extra else 0) for i in range(pp)]


@dataclass
class Plan:
    model: str
    gpu: str
    tp: int
    pp: int
    dp: int
    gpus: int
    micro_batch: int
    global_batch: int
    num_microbatches: int
    virtual_stages: int
    recompute: str
    sequence_parallel: bool
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
    tflops_per_gpu: float  # model FLOPs (no recompute) per second per GPU
    mfu: float
    breakdown: dict
    rampup_seconds: float | None = None
    rampup_steps: int | None = None
    cp: int = 1  # context-parallel ranks per sequence
    # What trains on the fullest stage's GPU: every parameter (full fine-tuning), or LoRA's adapters on a frozen base
    trainable_params: int = 0
    frozen_params: int = 0
    optimizer_state_gb: float = 0.0
    lora: dict | None = None  # LoRA's settings and bytes (`lora_plan.lora_summary`); None: full fine-tuning
    dpo: dict | None = None  # DPO's reference and its bytes (`dpo_plan`); None: language modelling
    grpo: dict | None = None  # GRPO's settings, reference, generation bytes and seconds (`grpo_plan`); None: not GRPO
    # Parameters one token goes through (a mixture of experts' k of E experts; the whole model when dense), as
    # `families.active_parameters` counts them; the FLOPs above count these.
    active_params: int = 0
    # The multi-token prediction depths' parameters (`families.mtp_parameters`), apart: transformers' model holds
    # none; params_per_gpu counts them on the last stage, the FLOPs count their compute. 0 without depths.
    mtp_params: int = 0
    ep: int = 1  # expert-parallel ranks (out of the dp ranks) each MoE layer's experts are split over
    muon: dict | None = None  # Muon's momentum, saved bytes and optimizer seconds (`muon_plan`); None: AdamW

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def layout_key(self) -> tuple[int, int, int, int, int]:
        return self.tp, self.cp, self.pp, self.dp, self.ep


def validate_layout(config: ModelConfig, tp: int, pp: int, dp: int, global_batch: int, micro_batch: int, virtual=1):
    """Raise MTNLGError naming the numbers when a layout cannot run at all."""
    if min(tp, pp, dp, micro_batch, virtual) < 1:
        raise MTNLGError(f"tp {tp}, pp {pp}, dp {dp}, micro-batch {micro_batch}, virtual stages {virtual} must be >= 1")
    if pp * virtual > config.num_layers:
        raise MTNLGError(
            f"pipeline_parallel {pp} x virtual stages {virtual} is more stages than the model's {config.num_layers}"
            f" layers"
        )
    if config.num_heads % tp:
        raise MTNLGError(f"num_heads {config.num_heads} is not divisible by tensor_parallel {tp}")
    if global_batch % (micro_batch * dp):
        raise MTNLGError(f"global batch {global_batch} is not divisible by micro_batch {micro_batch} x dp {dp}")


def plan(
    config: ModelConfig,
    tp: int,
    pp: int,
    dp: int,
    gpus_per_node: int,
    gpu: str | GPUSpec,
    global_batch: int,
    micro_batch: int = 1,
    recompute: str = "full",
    zero_stage: int = 1,
    *,
    precision: str = "bf16",
    layers: list[int] | None = None,
    virtual_stages: int = 1,
    sequence_parallel: bool = False,
    implementation: str | Implementation = "mtnlg-lightning",
    rampup: tuple[int, int, int] | list[int] | None = None,
    cp: int = 1,
    lora: LoRAConfig | None = None,
    dpo: PreferencePlan | None = None,
    ep: int = 1,
    grpo: GRPOPlan | None = None,
    muon: MuonPlan | None = None,
) -> Plan:
    """One layout: memory per GPU and the time of one iteration. `cp`: context-parallel ranks per sequence (each
    holds seq_len / cp of its tokens: activations, compute and logits divided by cp; the model states partitioned
    over dp x cp under ZeRO; the ring's key/value exchange costed in `cost_model`). `lora`: LoRA adapters train on
    a frozen base (`lora_plan`: its model states); activations and time are full fine-tuning's. `dpo`: preference
    pairs (`dpo_plan`: two sequences a sample, the reference's bytes and forward pass); batches count pairs. `ep`:
    expert-parallel ranks out of dp (each MoE layer's experts split over them: their states divided by ep, their
    gradients reduced over dp x cp / ep ranks, the routed rows' all-to-alls costed in `cost_model`). `grpo`: GRPO
    (`grpo_plan`: G sequences a prompt, its reference, and the step's generation: the KV cache, and under ZeRO-3 the
    gathered weights, beside the model states; the prefill and decode seconds before the training, over
    num_iterations steps); batches count prompts. `muon`: `--model.optimizer muon` (`muon_plan`: one momentum
    buffer for the hidden matrices, shared out over the replicas, instead of AdamW's two moments; the Newton-Schulz
    FLOPs, TP gather and DP broadcast in the optimizer's seconds; counted on the stage with the most parameters)."""
    spec = gpu if isinstance(gpu, GPUSpec) else get_gpu(gpu)
    impl = IMPLEMENTATIONS[implementation] if isinstance(implementation, str) else implementation
    per_gpu = _checked_layers(config, tp, pp, dp, cp, global_batch, micro_batch, recompute, sequence_parallel,
                              virtual_stages, layers)  # fmt: skip
    _check_experts(config, dp, ep)
    if dpo is not None and grpo is not None:
        raise MTNLGError(ONE_OBJECTIVE)
    refusal = grpo.refusal(zero_stage, bool(rampup)) if grpo is not None else None
    if refusal:
        raise MTNLGError(refusal)
    trained = dpo or grpo  # what a sample trains: its sequences and its reference
    per_sample = trained.sequences_per_sample if trained is not None else 1
    sequences = global_batch * per_sample
    layout = Layout(
        tp, pp, dp, micro_batch * per_sample, virtual_stages, zero_stage, recompute, sequence_parallel, cp, ep
    )
    stage_params = params_per_stage(config, tp, pp, per_gpu, ep)
    stage_experts = expert_params_per_stage(config, per_gpu, ep)
    fullest = max(range(pp), key=lambda i: stage_params[i])
    held = (stage_params[fullest], stage_experts[fullest])  # the fullest stage's parameters, of which experts
    memory = _memory(config, layout, sequences, per_gpu, stage_params, stage_experts, precision, lora, trained, grpo)
    breakdown = iteration_breakdown(config, spec, layout, sequences, per_gpu, held[0], gpus_per_node, impl, held[1])
    forward = (breakdown.compute - breakdown.recompute) / 3  # a forward: a third of a step's compute without recompute
    mu = grpo.num_iterations if grpo is not None else 1  # GRPO's steps a generation (and its forwards)
    if trained is not None and trained.reference_forward:
        breakdown.reference = forward / mu
    generation = (0.0, 0.0, 0.0)  # GRPO's (prefill, decode, gather) seconds: before the training, on every rank
    if grpo is not None:  # a decode step reads the rank's TP shard of every stage
        weight_bytes = STATE_BYTES[precision]["weights"]
        prefill, decode = grpo.seconds(config, spec, sum(stage_params) * weight_bytes, sequences // dp, tp, precision)
        gather = 0.0
        if zero_stage >= 3:  # the fullest stage's TP shard gathered whole over its replicas (experts over theirs)
            bandwidth = dp_bandwidth(spec, layout, gpus_per_node)
            dense, experts = (held[0] - held[1]) * weight_bytes, held[1] * weight_bytes
            gather = all_gather_seconds(dense, layout.replicas, bandwidth)
            gather += all_gather_seconds(experts, layout.replicas // ep, bandwidth)
        generation = (prefill, decode, gather)
        breakdown.generation = sum(generation) / mu  # in the step's time, not in its model FLOPs (training's only)
        breakdown.old_logps = forward / mu if mu > 1 else 0.0
    muon_summary, muon_delta = None, 0.0
    if muon is not None:
        if lora is not None:
            raise MTNLGError("model.optimizer muon does not train LoRA adapters: plan without --optimizer muon")
        first = sum(per_gpu[:fullest])
        muon_delta, extra, muon_summary = muon.stage(config, layout, first, per_gpu[fullest], spec, gpus_per_node)
        memory = memory | {"state": memory["state"] + muon_delta, "training": memory["training"] + muon_delta}
        if grpo is not None:
            memory["generation"] += muon_delta
        memory["total"] = max(memory["training"], memory["generation"])
        breakdown.optimizer += extra
    gpus = tp * cp * pp * dp
    model_flops = flops_per_iteration(config, sequences)
    seconds = breakdown.total
    rampup_seconds, rampup_steps = _rampup(
        config, spec, layout, global_batch, rampup, per_gpu, held, gpus_per_node, impl
    )
    return Plan(
        model=config.name,
        gpu=gpu if isinstance(gpu, str) else "custom",
        tp=tp,
        pp=pp,
        dp=dp,
        gpus=gpus,
        micro_batch=micro_batch,
        global_batch=global_batch,
        num_microbatches=global_batch // (micro_batch * dp),
        virtual_stages=virtual_stages,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        zero_stage=zero_stage,
        layers_per_stage=per_gpu,
        params_per_gpu=max(stage_params),
        model_state_gb=memory["state"] / 1e9,
        activation_gb=memory["activations"] / 1e9,
        total_gb=memory["total"] / 1e9,
        gpu_memory_gb=spec.memory_gb,
        fits=memory["total"] <= MEMORY_BUDGET * spec.memory_gb * 1e9,
        tp_within_node=tp <= gpus_per_node and gpus_per_node % tp == 0,
        bubble=breakdown.bubble / seconds,
        flops_per_iteration=flops_per_iteration(config, sequences, recompute=recompute == "full"),
        iteration_seconds=seconds,
        tflops_per_gpu=model_flops / seconds / gpus / 1e12,
        mfu=model_flops / seconds / gpus / (spec.peak_tflops * 1e12),
        breakdown=breakdown.as_dict(),
        rampup_seconds=rampup_seconds,
        rampup_steps=rampup_steps,
        cp=cp,
        trainable_params=memory["trained"].trainable_params,
        frozen_params=memory["trained"].frozen_params,
        optimizer_state_gb=(memory["trained"].optimizer_bytes + muon_delta) / 1e9,
        lora=lora_summary(lora, config, memory["trained"]) if lora is not None else None,
        dpo=dpo.summary(memory["reference"]) if dpo is not None else None,
        active_params=active_parameters(config),
        mtp_params=mtp_parameters(config),
        ep=ep,
        grpo=grpo.summary(memory["reference"], sequences // dp, memory, generation, seconds) if grpo else None,
        muon=muon_summary,
    )


def _checked_layers(
    config, tp, pp, dp, cp, global_batch, micro_batch, recompute, sequence_parallel, virtual_stages, layers
) -> list[int]:
    """Blocks per pipeline rank (all its virtual chunks), after every check a layout must pass (one line each)."""
    if recompute not in RECOMPUTE_MODES:
        raise MTNLGError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if sequence_parallel and config.seq_len % tp:
        raise MTNLGError(f"sequence parallelism needs seq_len {config.seq_len} divisible by tensor_parallel {tp}")
    validate_layout(config, tp, pp, dp, global_batch, micro_batch, virtual_stages)
    if cp < 1 or (cp > 1 and config.seq_len % (2 * cp)):
        raise MTNLGError(f"seq_len {config.seq_len} is not divisible by 2 x context_parallel {cp}")
    if virtual_stages > 1 and layers:
        raise MTNLGError("explicit layers per stage and virtual stages cannot be combined")
    chunks = layers or balanced_layers(config.num_layers, pp * virtual_stages)
    if len(chunks) != pp * virtual_stages or sum(chunks) != config.num_layers:
        raise MTNLGError(f"layers per stage {chunks} must be {pp} counts summing to {config.num_layers}")
    # Chunk j of an interleaved schedule lives on pipeline rank j % pp.
    return [sum(chunks[j] for j in range(i, len(chunks), pp)) for i in range(pp)]


def _check_experts(config: ModelConfig, dp: int, ep: int) -> None:
    if ep == 1:
        return
    if not config.moe:
        raise MTNLGError(f"expert_parallel {ep} needs a mixture-of-experts model ({config.name} has no experts)")
    if ep < 1 or dp % ep or config.num_experts % ep:
        raise MTNLGError(
            f"expert_parallel {ep} must divide the data-parallel size {dp} and num_experts {config.num_experts}"
        )


def _memory(config, layout: Layout, global_batch, per_gpu, stage_params, stage_experts, precision, lora, trained,
            grpo=None) -> dict:  # fmt: skip
    """Model states (with the reference of DPO or GRPO, `trained`, if it holds one), activations and their total
    (bytes) on the fullest pipeline stage, and what trains there (`lora_plan.StageState`). A stage's experts
    (`stage_experts`, of `stage_params`) are partitioned over their own replicas, dp x cp / ep, under ZeRO. GRPO's
    generation holds the model states and its KV cache and prefill, but no training activation: the total is the
    larger of the two peaks, and under ZeRO-3 its generating peak holds the stage's gathered weights besides
    (`grpo_plan`)."""
    tp, pp, micro = layout.tp, layout.pp, layout.micro_batch
    local = config.seq_len // layout.cp  # the tokens of each sequence this rank holds
    num_microbatches = global_batch // (micro * layout.dp)
    # 1F1B: stage i keeps activations of min(pp - i, m) micro-batches in flight; interleaving adds (p-1)/(p·v).
    in_flight = [min(pp - i, num_microbatches) for i in range(pp)]
    v = layout.virtual_stages
    interleave = 1 + (pp - 1) / (pp * v) if v > 1 else 1.0
    sp = layout.sequence_parallel
    per_layer = activation_bytes_per_layer(config, micro, tp, layout.recompute, seq_len=local, sequence_parallel=sp)
    # Working set while (re)computing one layer, plus fp32 logits of the last stage.
    working = 0.0
    if layout.recompute != "none":
        working = activation_bytes_per_layer(config, micro, tp, "none", seq_len=local, sequence_parallel=sp)
    logits = 4 * local * micro * config.padded_vocab_size(tp) / tp
    stages, generating = [], [(0.0,) * 5]
    rows = global_batch // layout.dp  # GRPO: this replica's sequences, generated in one batch by each of its ranks
    parts = partial(model_state_parts, dp=layout.replicas, zero_stage=layout.zero_stage, precision=precision)
    expert_parts = partial(parts, dp=layout.replicas // layout.ep)
    for i in range(pp):
        act = per_layer * per_gpu[i] * in_flight[i] * interleave + working + (logits if i == pp - 1 else 0)
        state = stage_state(parts, stage_params[i], per_gpu[i], config, tp, lora, stage_experts[i], expert_parts)
        reference = trained.reference_bytes(parts(stage_params[i])[0]) if trained is not None else 0.0
        kept = grpo.kept_bytes(rows, config.seq_len, i == pp - 1) if grpo is not None else 0.0
        stages.append((act + state.total + reference + kept, act, state, reference))
        if grpo is not None:
            kv, prefill = grpo.memory(config, per_gpu[i], rows, tp, precision, i == pp - 1)
            # ZeRO-3: the stage's TP shard gathered whole (frozen base and adapters under LoRA) beside its partitions
            gathered = 0.0
            if layout.zero_stage >= 3:
                gathered = (state.frozen_params + state.trainable_params) * STATE_BYTES[precision]["weights"]
            generating.append((state.total + reference + kv + prefill + gathered + kept, kv, prefill, gathered, kept))
    total, act, state, reference = max(stages, key=lambda stage: stage[:2])
    generation, kv, prefill, gathered, kept = max(generating)
    return {"state": state.total + reference, "activations": act, "total": max(total, generation), "trained": state,
            "reference": reference, "training": total, "generation": generation, "kv_cache": kv,
            "prefill_working": prefill, "gathered_weights": gathered, "kept_rows": kept,
            "prompt": grpo.prompt_tokens(config.seq_len) if grpo else 0}  # fmt: skip


def _rampup(config, spec, layout: Layout, global_batch, rampup, per_gpu, held, gpus_per_node, impl):
    """(seconds, steps) of the batch ramp-up, each batch size timed once; (None, None) without one. `held`: the
    fullest stage's (parameters, of which experts)."""
    if not rampup:
        return None, None
    schedule = BatchSizeSchedule(global_batch, *rampup)
    schedule.check_divisible(layout.micro_batch, layout.dp)
    seconds, steps, consumed, cache = 0.0, 0, 0, {}
    while consumed < schedule.rampup_samples:
        batch = schedule.batch_size_at_samples(consumed)
        if batch not in cache:
            cache[batch] = iteration_breakdown(
                config, spec, layout, batch, per_gpu, held[0], gpus_per_node, impl, held[1]
            ).total
        seconds += cache[batch]
        steps += 1
        consumed += batch
    return seconds, steps


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def search(
    config: ModelConfig,
    num_gpus: int,
    gpus_per_node: int,
    gpu: str | GPUSpec,
    global_batch: int,
    precision: str = "bf16",
    implementation: str | Implementation = "mtnlg-lightning",
    micro_batches: tuple[int, ...] = (1, 2, 4, 8),
    recompute_modes: tuple[str, ...] | None = None,
    lora: LoRAConfig | None = None,
    dpo_reference: str | None = None,
    grpo: GRPOPlan | None = None,
) -> list[Plan]:
    """Every valid layout (tp, cp, pp, dp, ep, virtual stages, micro-batch, ZeRO, recompute, SP) that fits, fastest
    first.

    TP stays inside a node; CP (where the implementation has it) divides the sequence into 2 x CP chunks; ZeRO-3 is
    not combined with pipelining (as the strategy); interleaving needs the micro-batch count to be a multiple of
    the stages (as Megatron's schedule); pipelines the implementation cannot run (`Implementation.runs_pipeline`:
    Megatron's even layer split, no interleaving on 2 stages) are skipped. A mixture-of-experts model adds each EP
    dividing both dp and its experts. `dpo_reference` (`dpo_plan.REFERENCES`):
    DPO on pairs, without the layouts it cannot run (a reference copy under ZeRO-3). `grpo` (`grpo_plan`): GRPO's
    steps, without the layouts the trainer refuses for it (a full-weight reference copy under ZeRO-3)."""
    impl = IMPLEMENTATIONS[implementation] if isinstance(implementation, str) else implementation
    modes = [r for r in (recompute_modes or impl.recompute_modes) if r in impl.recompute_modes]
    plans = []
    tps = [t for t in (1, 2, 4, 8, 16) if t <= gpus_per_node and gpus_per_node % t == 0 and config.num_heads % t == 0]
    cps = [c for c in (1, 2, 4, 8, 16, 32) if c == 1 or (impl.context_parallel and config.seq_len % (2 * c) == 0)]
    for tp, cp in itertools.product(tps, cps):
        if num_gpus % (tp * cp):
            continue
        for pp in _divisors(num_gpus // (tp * cp)):
            dp = num_gpus // (tp * cp * pp)
            if pp > config.num_layers:
                continue
            virtuals = [
                v
                for v in range(1, impl.max_virtual_stages + 1)
                if (v == 1 or pp > 1) and impl.runs_pipeline(config.num_layers, pp, v)
            ]
            sps = (False, True) if tp > 1 and impl.sequence_parallel and (config.seq_len // cp) % tp == 0 else (False,)
            zeros = [z for z in impl.zero_stages if (dp * cp > 1 or z == 0) and not (z == 3 and pp > 1)]
            eps = [e for e in _divisors(dp) if config.num_experts % e == 0] if config.moe else [1]
            for micro, v, recompute, sp, zero, ep in itertools.product(micro_batches, virtuals, modes, sps, zeros, eps):
                if global_batch % (micro * dp) or (grpo is not None and grpo.refusal(zero)):
                    continue
                m = global_batch // (micro * dp)
                if v > 1 and m % pp:
                    continue
                dpo = None
                if dpo_reference is not None:
                    if dpo_reference == "copy" and lora is None and zero >= 3:
                        continue
                    dpo = preference_plan(dpo_reference, lora is not None, zero)
                candidate = plan(
                    config, tp, pp, dp, gpus_per_node, gpu, global_batch, micro, recompute, zero,
                    precision=precision, virtual_stages=v, sequence_parallel=sp, implementation=impl, cp=cp,
                    lora=lora, dpo=dpo, ep=ep, grpo=grpo,
                )  # fmt: skip
                if candidate.fits:
                    plans.append(candidate)
    return sorted(plans, key=lambda p: (p.iteration_seconds, p.total_gb))


def best_per_layout(plans: list[Plan]) -> list[Plan]:
    """The fastest plan of each (tp, cp, pp, dp, ep) decomposition, fastest first (plans must be sorted)."""
    seen, best = set(), []
    for p in plans:
        if p.layout_key not in seen:
            seen.add(p.layout_key)
            best.append(p)
    return best


def format_breakdown(p: Plan) -> str:
    b, total = p.breakdown, p.iteration_seconds
    parts = [
        ("compute", b["compute"] - b["recompute"]),
        ("recompute", b["recompute"]),
        ("TP comm", b["tp_comm"]),
        ("PP comm", b["pp_comm"]),
        ("bubble", b["bubble"]),
        ("DP comm", b["dp_comm"]),
        ("CP ring", b.get("cp_comm", 0.0)),
        ("EP all-to-all", b.get("ep_comm", 0.0)),
        ("optimizer", b["optimizer"]),
        (f"{'GRPO' if p.grpo else 'DPO'} reference", b.get("reference", 0.0)),
        ("GRPO old log-probs", b.get("old_logps", 0.0)),
        ("GRPO generation", b.get("generation", 0.0)),
    ]
    return ", ".join(f"{name} {seconds:.3g} s ({seconds / total:.0%})" for name, seconds in parts if seconds > 0)


def format_plan(p: Plan) -> str:
    gb = lambda x: f"{x:,.1f} GB"  # noqa: E731
    schedule = f"interleaved 1F1B, {p.virtual_stages} chunks per GPU" if p.virtual_stages > 1 else "1F1B"
    lines = [
        f"model {p.model} on {p.gpu}: TP {p.tp} x {f'CP {p.cp} x ' if p.cp > 1 else ''}PP {p.pp} x DP {p.dp} = "
        f"{p.gpus} GPUs{f' (experts over EP {p.ep} of the DP ranks)' if p.ep > 1 else ''}, "
        f"micro-batch {p.micro_batch}, "
        f"global batch {p.global_batch} ({p.num_microbatches} micro-batches per pipeline)",
        f"  layers per stage     {p.layers_per_stage if len(set(p.layers_per_stage)) > 1 else p.layers_per_stage[0]}"
        f" ({schedule})",
        f"  params per GPU       {p.params_per_gpu / 1e9:,.3f} B (largest stage"
        f"{f'; the MTP depths, {p.mtp_params / 1e9:,.3f} B in all, on the last' if p.mtp_params else ''})",
        f"  model states         {gb(p.model_state_gb)} (ZeRO-{p.zero_stage}"
        f"{', LoRA: frozen base and trained adapters' if p.lora else ''})",
        f"  activations          {gb(p.activation_gb)} (recompute: {p.recompute}, sequence parallel: "
        f"{'yes' if p.sequence_parallel else 'no'}, in-flight micro-batches of the fullest stage)",
        f"  total / GPU memory   {gb(p.total_gb)} / {gb(p.gpu_memory_gb)} -> {'fits' if p.fits else 'DOES NOT FIT'}"
        f" ({MEMORY_BUDGET:.0%} budget)",
        f"  TP inside a node     {'yes' if p.tp_within_node else 'NO: TP all-reduces would cross nodes'}",
        f"  pipeline bubble      {p.bubble:.1%} of the iteration",
        f"  FLOPs per iteration  {p.flops_per_iteration:.3e} ({'with' if p.recompute == 'full' else 'without'} "
        f"full-recompute FLOPs)",
        f"  iteration time       {p.iteration_seconds:,.2f} s -> {p.tflops_per_gpu:,.0f} model TFLOP/s per GPU "
        f"(MFU {p.mfu:.1%})",
        f"  time breakdown       {format_breakdown(p)}",
    ]
    if p.lora is not None:
        lines[4:4] = format_lora(p.lora, p.frozen_params, p.trainable_params, p.zero_stage)
    if p.dpo is not None:
        lines.insert(4, format_dpo(p.dpo))
    if p.grpo is not None:
        lines[4:4] = format_grpo(p.grpo)
    if p.muon is not None:
        lines.insert(4, format_muon(p.muon))
    if p.rampup_seconds is not None:
        lines.append(
            f"  batch ramp-up        {p.rampup_steps:,} steps in {p.rampup_seconds / 3600:,.1f} h "
            f"({p.rampup_seconds / p.rampup_steps:,.2f} s per step on average)"
        )
    return "\n".join(lines)
