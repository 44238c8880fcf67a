"""Time of one training iteration of a GPT layout, from the GPU's data sheet and a few fitted efficiencies.

Per transformer layer and micro-batch, on one GPU (t = TP degree, b micro-batch, s sequence, h hidden, a heads):
- GEMMs: 2·b·s·(4h² + 2h·f)/t FLOPs forward, each of the four weight GEMMs at an efficiency that falls with its
  own narrowest per-GPU dimension (`GPUSpec.gemm_fraction`): QKV and FC1 are column-parallel (N = 3h/t, f/t), the
  attention projection and FC2 row-parallel (K = h/t, f/t), and M = b·s; so at TP t only the projection (1/12 of
  the GEMM FLOPs) is as narrow as h/t. Backward is twice the forward (its GEMMs permute the same dimensions).
- attention core (QK^T, AV): 4·b·s²·h/t FLOPs forward at its own efficiency.
- memory-bound kernels (LayerNorm, bias+dropout+residual, GeLU; softmax and dropout on the s x s scores when the
  attention is not a fused flash kernel) as bytes over the HBM bandwidth. Sequence parallelism shards the
  LayerNorm/dropout/residual part by t (Korthikanti et al. 2022).
- recompute: `full` re-runs the forward, `selective` re-runs the attention core only.
- TP communication: 2 all-reduces (or all-gather + reduce-scatter with SP, the same bytes) of b·s·h bf16 values
  per pass, over NVLink; what the software overlaps with GEMMs is hidden (`Implementation.tp_overlap`).
The last stage adds the LM head (3 logits GEMMs) and the cross-entropy; pipeline sends cross nodes when a stage
fills whole nodes, 2v per micro-batch (interleaving multiplies the traffic by v: Narayanan et al. 2021, Section
2.2.2), plus the all-reduce of the tied embedding's gradient between the first and last stage. The pipeline runs
m micro-batches plus a bubble of (p-1)/v stage-times (1F1B, interleaved with v chunks per GPU) and the 2(p-1)
sends that filling and draining it wait for. Which pipelines exist depends on the software
(`Implementation.runs_pipeline`: Megatron-LM splits layers evenly and did not interleave 2 stages).
Data-parallel gradients are reduced over the inter-node network once per iteration (ZeRO-2/3 as DeepSpeed runs
them: per micro-batch), exposed unless overlapped with the last backward; the optimizer step is memory-bound
(~32 bytes per local parameter). Expert parallelism (EP ranks out of DP, each holding E/EP experts of every MoE
layer): each MoE layer sends its routed rows to their experts and back by all-to-all, not overlapped
(`all_to_all_bytes`), and the experts' gradients are reduced over the DP/EP ranks holding the same experts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.families import ROW, kv_heads_per_rank, linear_shapes_per_rank
from mtnlg_lightning.gpus import GPUSpec

BF16 = 2
OPTIMIZER_BYTES_PER_PARAM = 32  # Adam on fp32 master: read+write master, m, v (24) + fp32 grad (4) + bf16 weight (2+)


@dataclass(frozen=True)
class Implementation:
    """What the training software fuses and overlaps: which costs end up on the critical path."""

    attention: str = "flash"  # "flash": fused kernel, no s x s tensor in HBM; "unfused": softmax/dropout through HBM
    tp_overlap: str = "none"  # "none" | "backward" (input-grad all-reduce under the weight-grad GEMM) | "all"
    dp_overlap: bool = False  # gradient reduction overlapped with the backward of the last micro-batch
    grad_reduce_bytes: int = 4  # bytes per gradient element reduced over DP (fp32 accumulation: 4, fp16: 2)
    # HBM bytes per local parameter and micro-batch to add a fresh gradient into the accumulated one (read new,
    # read + write sum); 0 when the weight-gradient GEMM accumulates in place (Megatron's gradient-accumulation
    # fusion). This trainer: fp32 parameters under autocast, autograd sums fp32 .grad: 4 + 4 + 4.
    grad_accumulation_bytes: int = 12
    scatter_gather: bool = False  # pipeline sends split across the TP ranks (1/t of the bytes per GPU)
    recompute_modes: tuple[str, ...] = ("none", "selective", "full")
    sequence_parallel: bool = True  # whether SP is available
    context_parallel: bool = True  # whether CP (ring attention over a split sequence) is available
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    max_virtual_stages: int = 4
    # Pipeline layouts the software accepts. Megatron-LM splits layers evenly: num_layers divisible by the stages
    # (and by pp x v chunks when interleaved: --num-layers-per-virtual-pipeline-stage must divide num_layers / pp),
    # and until its p2p overlap option (2023) refused the interleaved schedule on 2 stages ("pipeline-model-parallel
    # size should be greater than 2 with interleaved schedule", megatron/arguments.py). This trainer and DeepSpeed's
    # pipeline engine take uneven splits.
    even_layer_split: bool = False
    interleave_min_pp: int = 2

    def runs_pipeline(self, num_layers: int, pp: int, virtual_stages: int) -> bool:
        """Whether this software can run `pp` stages of `virtual_stages` chunks each on `num_layers` layers."""
        if virtual_stages > 1 and (virtual_stages > self.max_virtual_stages or pp < self.interleave_min_pp):
            return False
        return pp * virtual_stages <= num_layers and not (self.even_layer_split and num_layers % (pp * virtual_stages))


IMPLEMENTATIONS = {
    # This trainer: SDPA (flash kernels on GPU); TP collectives are not overlapped; pipeline sends are whole
    # activations from every TP rank (sequence shards with SP); DeepSpeed ZeRO overlaps only in stage 2.
    "mtnlg-lightning": Implementation(),
    # Megatron-LM as in Narayanan et al. 2021: fused scale-mask-softmax (no flash), no TP/DP overlap, fp16
    # gradients all-reduced, scatter/gather pipeline sends, full or no recompute, no ZeRO.
    "megatron-2021": Implementation(
        attention="unfused",
        grad_reduce_bytes=2,
        grad_accumulation_bytes=6,  # fp16 main_grad += fp16 grad in the DDP hook
        scatter_gather=True,
        recompute_modes=("none", "full"),
        sequence_parallel=False,
        context_parallel=False,
        zero_stages=(0,),
        even_layer_split=True,
        interleave_min_pp=3,
    ),
    # Megatron-DeepSpeed as MT-NLG ran it: bf16 with fp32 gradient reduction, ZeRO-1, DeepSpeed's pipeline engine
    # (partitioned sends, no DP overlap), 1F1B only.
    "megatron-deepspeed-2021": Implementation(
        attention="unfused",
        grad_reduce_bytes=4,
        grad_accumulation_bytes=10,  # bf16 grads added into the fp32 accumulation after every micro-step
        scatter_gather=True,
        recompute_modes=("none", "full"),
        sequence_parallel=False,
        context_parallel=False,
        zero_stages=(0, 1),
        max_virtual_stages=1,
    ),
    # Megatron-LM as in Korthikanti et al. 2022: adds SP and selective recompute; the input-gradient all-reduce
    # overlaps the weight-gradient GEMM (their Table 4 note); no DP overlap.
    "megatron-2022": Implementation(
        attention="unfused",
        tp_overlap="backward",
        grad_reduce_bytes=4,
        grad_accumulation_bytes=0,  # --gradient-accumulation-fusion
        scatter_gather=True,
        zero_stages=(0,),
        even_layer_split=True,
        interleave_min_pp=3,
    ),
    # Megatron-Core r0.8 (its H100 table): TE fused attention, --tp-comm-overlap, --overlap-grad-reduce and
    # --overlap-param-gather with the distributed optimizer (ZeRO-1).
    "megatron-core-0.8": Implementation(
        attention="flash",
        tp_overlap="all",
        dp_overlap=True,
        grad_reduce_bytes=4,
        grad_accumulation_bytes=0,
        scatter_gather=True,
        zero_stages=(0, 1),
        even_layer_split=True,
    ),
}


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch: int = 1
    virtual_stages: int = 1
    zero_stage: int = 1
    recompute: str = "full"
    sequence_parallel: bool = False
    cp: int = 1  # context parallelism: each sequence's tokens split over cp ranks, attention by a ring
    ep: int = 1  # expert parallelism: each MoE layer's experts split over ep of the dp ranks

    @property
    def replicas(self) -> int:
        """Ranks holding the same weight shard (DP x CP): gradients are reduced and ZeRO partitions over them."""
        return self.dp * self.cp


@dataclass
class Breakdown:
    """Seconds per iteration on the critical path. `compute` includes `recompute`; the rest are exposed."""

    compute: float
    recompute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    cp_comm: float = 0.0  # the ring's key/value exchange not hidden under the attention it overlaps
    reference: float = 0.0  # DPO's (GRPO's) reference pass: a forward of the step's sequences, no gradients
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (routed rows to their experts and back)
    generation: float = 0.0  # GRPO's sampling of the step's completions before its training (`grpo_plan`)
    old_logps: float = 0.0  # GRPO with num_iterations > 1: the generating policy's forward of the rows

    @property
    def total(self) -> float:
        exposed = self.tp_comm + self.pp_comm + self.bubble + self.dp_comm + self.optimizer + self.cp_comm
        return self.compute + self.reference + exposed + self.ep_comm + self.generation + self.old_logps

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _allreduce_seconds(nbytes: float, ranks: int, bandwidth: float) -> float:
    """Ring all-reduce: every rank moves 2(n-1)/n of the bytes over its link (`bandwidth` is bytes/s)."""
    return 0.0 if ranks <= 1 else 2 * (ranks - 1) / ranks * nbytes / bandwidth


def all_gather_seconds(nbytes: float, ranks: int, bandwidth: float) -> float:
    """Ring all-gather of `nbytes` whole from `ranks` partitions: half an all-reduce."""
    return 0.5 * _allreduce_seconds(nbytes, ranks, bandwidth)


def _layer_gemm_shapes(config: ModelConfig, t: int) -> list[tuple[float, float]]:
    """(K, N) of the weight GEMMs of a layer on one TP rank (M is the micro-batch's tokens), from the family's
    tensor-parallel plan (`families.linear_shapes_per_rank`): column-parallel layers N sharded, row-parallel K
    sharded, key/value heads fewer (grouped-query) or replicated. The attention's input projections are one GEMM
    (q/k/v fused, as Megatron runs them). The backward's data- and weight-gradient GEMMs permute the same three
    dimensions."""
    qkv, rest = [], []
    for path, (style, n, k) in linear_shapes_per_rank(config, t).items():
        (qkv if path.startswith("attn.") and style != ROW else rest).append((k, n))
    return [(qkv[0][0], sum(n for _, n in qkv)), *rest]


def _layer_pass_seconds(config: ModelConfig, gpu: GPUSpec, impl: Implementation, layout: Layout) -> dict:
    """Forward, backward, recompute and TP-communication seconds of one layer for one micro-batch."""
    t, b, s, h, a = layout.tp, layout.micro_batch, config.seq_len, config.hidden_size, config.num_heads
    f = config.ffn_hidden_size
    peak = gpu.peak_tflops * 1e12
    hbm = gpu.hbm_tbps * 1e12 * gpu.hbm_efficiency
    local = s / layout.cp  # this rank's tokens of each sequence; its queries still meet every key
    tokens = b * local
    gemm = sum(
        2 * tokens * k * n / (peak * gpu.gemm_fraction(min(tokens, k, n))) for k, n in _layer_gemm_shapes(config, t)
    )
    attention = 4 * b * local * s * a * config.head_dim / t / (peak * gpu.attention_efficiency)
    # Elementwise bf16 traffic, in elements: LayerNorms + bias/dropout/residual (replicated over TP unless SP),
    # bias+GeLU on the f-wide activation (sharded); unfused attention: scale/mask/softmax + dropout on the scores.
    # 6 elements per token and hidden unit for the replicated part: what sequence parallelism saved in
    # Korthikanti et al.'s Table 4 (22B, TP 8: 7.7 -> 7.2 ms forward per layer).
    replicated = 6 * tokens * h / (t if layout.sequence_parallel else 1)
    sharded = 2 * tokens * f / t
    scores = 4.5 * b * a * local * s / t if impl.attention == "unfused" else 0.0
    elementwise = (replicated + sharded) * BF16 / hbm
    score_traffic = scores * BF16 / hbm
    overhead = gpu.kernel_overhead_us * 1e-6
    # The ring (context parallelism) runs CP block kernels instead of one and merges each block's fp32 output into
    # the running one (read both, write one): what CP costs over DP at the same tokens per GPU.
    ring_merges = (layout.cp - 1) * 3 * tokens * a * config.head_dim / t * 4 / hbm if layout.cp > 1 else 0.0
    overhead *= layout.cp
    forward = gemm + attention + elementwise + score_traffic + ring_merges + overhead
    backward = 2 * (gemm + attention + elementwise + score_traffic + ring_merges) + overhead
    recompute = {"full": forward, "selective": attention + score_traffic, "none": 0.0}[layout.recompute]
    # TP: 2 all-reduce-equivalents forward, 2 backward, 2 more when the full forward is recomputed.
    one = _allreduce_seconds(tokens * h * BF16, t, gpu.nvlink_gbps * 1e9 * gpu.nvlink_efficiency)
    fwd_comm, bwd_comm = 2 * one, 2 * one
    if impl.tp_overlap == "all":
        fwd_comm, bwd_comm = max(0.0, fwd_comm - gemm), max(0.0, bwd_comm - 2 * gemm)
    elif impl.tp_overlap == "backward":
        bwd_comm = max(0.0, bwd_comm - gemm)  # under the weight-gradient GEMMs
    tp_comm = fwd_comm * (2 if layout.recompute == "full" else 1) + bwd_comm
    return {
        "forward": forward,
        "backward": backward,
        "recompute": recompute,
        "tp_comm": tp_comm,
        "attention": attention + score_traffic,
    }


def _ring_seconds(config: ModelConfig, gpu: GPUSpec, layout: Layout, gpus_per_node: int, attention: float) -> float:
    """Exposed seconds of one layer's ring exchange for one micro-batch (context parallelism): the forward passes
    a key/value chunk CP-1 times, the backward the chunk again and its gradient CP times; each overlaps the block
    attention it feeds. Inside a node while TP x CP fits it (NVLink), else over the network."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    kv_heads = kv_heads_per_rank(config, layout.tp)
    chunk = 2 * layout.micro_batch * config.seq_len / cp * kv_heads * config.head_dim * BF16  # k and v
    inside = layout.tp * cp <= gpus_per_node
    bandwidth = gpu.nvlink_gbps * gpu.nvlink_efficiency if inside else gpu.network_gbps * gpu.network_efficiency
    forward, backward = (cp - 1) * chunk / (bandwidth * 1e9), (2 * cp - 1) * chunk / (bandwidth * 1e9)
    return max(0.0, forward - attention) + max(0.0, backward - 2 * attention)


def all_to_all_bytes(config: ModelConfig, layout: Layout, sequences: int = 1) -> float:
    """Bytes one rank sends to other ranks in the expert-parallel all-to-alls of one MoE layer, forward and
    backward, for `sequences` sequences of its data-parallel share: its tokens (a CP rank's part of each sequence,
    a TP rank's slice under SP, every token on every TP rank without) each go to k experts as a row of h bf16
    values, dispatched and combined forward, their gradients the same way back (4 passes); routed evenly, (EP-1)/EP
    of the rows leave the rank. 0 without expert parallelism."""
    if layout.ep == 1:
        return 0.0
    tokens = sequences * config.seq_len / layout.cp / (layout.tp if layout.sequence_parallel else 1)
    rows = tokens * config.experts_per_token
    return 4 * rows * config.hidden_size * BF16 * (layout.ep - 1) / layout.ep


def _all_to_all_seconds(config: ModelConfig, gpu: GPUSpec, layout: Layout, gpus_per_node: int) -> float:
    """Seconds of one MoE layer's all-to-alls for one micro-batch (a full recompute repeats the forward's two).
    An EP group is EP consecutive DP ranks of one TP and CP rank (ranks laid out (pp, dp, cp, tp)), spanning
    TP x CP x EP ranks: inside a node while that fits one (NVLink), else over the network."""
    inside = layout.tp * layout.cp * layout.ep <= gpus_per_node
    bandwidth = gpu.nvlink_gbps * gpu.nvlink_efficiency if inside else gpu.network_gbps * gpu.network_efficiency
    passes = 6 / 4 if layout.recompute == "full" else 1.0
    return passes * all_to_all_bytes(config, layout, layout.micro_batch) / (bandwidth * 1e9)


def _head_seconds(config: ModelConfig, gpu: GPUSpec, layout: Layout) -> float:
    """LM head on the last stage for one micro-batch: logits GEMM forward + 2 backward, fp32 cross-entropy."""
    t, tokens, h = layout.tp, layout.micro_batch * config.seq_len / layout.cp, config.hidden_size
    vocab = config.padded_vocab_size(t) / t
    gemm = 3 * 2 * tokens * h * vocab / (gpu.peak_tflops * 1e12 * gpu.gemm_fraction(min(tokens, h, vocab)))
    cross_entropy = 6 * tokens * vocab * 4 / (gpu.hbm_tbps * 1e12 * gpu.hbm_efficiency)
    return gemm + cross_entropy


def dp_bandwidth(gpu: GPUSpec, layout: Layout, gpus_per_node: int) -> float:
    """Bus bandwidth (bytes/s) of a gradient collective over the DP x CP replicas. Ranks are laid out
    (pp, dp, cp, tp) with TP innermost, so a node holds gpus_per_node / tp members of each replica group; NCCL
    drives one NIC per member."""
    members_per_node = max(1, gpus_per_node // layout.tp)
    nvlink = gpu.nvlink_gbps * 1e9 * gpu.nvlink_efficiency
    if layout.replicas <= members_per_node:
        return nvlink
    return min(nvlink, members_per_node * gpu.network_gbps * 1e9 * gpu.network_efficiency)


def iteration_breakdown(
    config: ModelConfig,
    gpu: GPUSpec,
    layout: Layout,
    global_batch: int,
    layers_per_gpu: list[int],
    params_per_gpu: int,
    gpus_per_node: int = 8,
    impl: Implementation | None = None,
    expert_params_per_gpu: int = 0,
) -> Breakdown:
    """Seconds of one iteration at `global_batch` sequences. `layers_per_gpu[i]`: blocks on pipeline rank i (all
    its virtual chunks); `params_per_gpu`: parameters of the largest stage's TP shard (for DP and optimizer), of
    which `expert_params_per_gpu` are experts (reduced over DP / EP ranks only)."""
    impl = impl or IMPLEMENTATIONS["mtnlg-lightning"]
    p, v, d = layout.pp, layout.virtual_stages, layout.dp
    m = global_batch // (layout.micro_batch * d)
    layer = _layer_pass_seconds(config, gpu, impl, layout)
    per_layer = layer["forward"] + layer["backward"] + layer["recompute"]
    head = _head_seconds(config, gpu, layout)
    hbm = gpu.hbm_tbps * 1e12 * gpu.hbm_efficiency
    accumulate = params_per_gpu * impl.grad_accumulation_bytes / hbm if m > 1 else 0.0
    stage_compute = [n * per_layer + (head if i == p - 1 else 0.0) + accumulate for i, n in enumerate(layers_per_gpu)]
    stage_tp = [n * layer["tp_comm"] for n in layers_per_gpu]
    ring = _ring_seconds(config, gpu, layout, gpus_per_node, layer["attention"])
    slowest = max(range(p), key=lambda i: stage_compute[i] + stage_tp[i])

    # Pipeline sends: activations of one micro-batch, forward and backward, at each of the v chunk boundaries
    # (Narayanan et al. 2021, Section 2.2.2: interleaving multiplies this traffic by v). Megatron's sends are
    # blocking (batched isend/irecv, then a wait), so each is on the critical path.
    pp_comm = send = 0.0
    if p > 1:
        shard = layout.tp if (impl.scatter_gather or layout.sequence_parallel) else 1
        nbytes = layout.micro_batch * config.seq_len / layout.cp * config.hidden_size * BF16 / shard
        crosses_node = layout.tp * layout.cp * d >= gpus_per_node
        bandwidth = (gpu.network_gbps * gpu.network_efficiency if crosses_node else gpu.nvlink_gbps) * 1e9
        send = nbytes / bandwidth
        pp_comm = m * 2 * v * send
        # The tied word embedding: its gradient is all-reduced between the first and the last stage every
        # iteration (Megatron's embedding group), V·h/t values per TP rank over that rank's own link.
        # The first and last stage are (p-1)·t·d ranks apart: on different nodes once that spans a node.
        embedding = config.padded_vocab_size(layout.tp) * config.hidden_size / layout.tp * impl.grad_reduce_bytes
        apart = (p - 1) * layout.tp * layout.cp * d >= gpus_per_node
        link = (gpu.network_gbps * gpu.network_efficiency if apart else gpu.nvlink_gbps) * 1e9
        pp_comm += _allreduce_seconds(embedding, 2, link)

    # Bubble: (p-1)/v stage-times of fill and drain (1F1B; interleaved with v chunks). Filling and draining also
    # cross the p-1 stage boundaries one after another, forward and backward: 2(p-1) sends on the critical path.
    busy = stage_compute[slowest] + stage_tp[slowest]
    bubble = (p - 1) / v * busy + 2 * (p - 1) * send if p > 1 else 0.0

    # Data parallelism: gradients reduced (all-reduce, or reduce-scatter + parameter all-gather under ZeRO) over
    # every replica of the weights, DP x CP; an expert's over the DP x CP / EP ranks holding it.
    d = layout.replicas
    backward_window = layers_per_gpu[slowest] * layer["backward"]
    dense = params_per_gpu - expert_params_per_gpu
    dp_comm = _dp_seconds(dense, d, m, layout, impl, dp_bandwidth(gpu, layout, gpus_per_node), backward_window)
    copies = d // layout.ep  # ranks holding the same experts: every EP-th DP rank, TP x EP ranks apart
    if expert_params_per_gpu:
        bandwidth = dp_bandwidth(gpu, replace(layout, dp=layout.dp // layout.ep, tp=layout.tp * layout.ep),
                                 gpus_per_node)  # fmt: skip
        dp_comm += _dp_seconds(expert_params_per_gpu, copies, m, layout, impl, bandwidth, backward_window)
    moe_layers = layers_per_gpu[slowest] * len(config.moe_layers) / config.num_layers

    shard, expert_shard = (d, copies) if layout.zero_stage >= 1 else (1, 1)
    optimizer = (dense / shard + expert_params_per_gpu / expert_shard) * OPTIMIZER_BYTES_PER_PARAM / hbm
    cp_comm = m * layers_per_gpu[slowest] * ring
    ep_comm = m * moe_layers * _all_to_all_seconds(config, gpu, layout, gpus_per_node)
    return Breakdown(
        compute=m * stage_compute[slowest],
        recompute=m * layers_per_gpu[slowest] * layer["recompute"],
        tp_comm=m * stage_tp[slowest],
        pp_comm=pp_comm,
        bubble=bubble,
        dp_comm=dp_comm,
        optimizer=optimizer,
        cp_comm=cp_comm,
        ep_comm=ep_comm,
    )


def _dp_seconds(params: int, replicas: int, m: int, layout: Layout, impl: Implementation, bandwidth, backward) -> float:
    """Exposed seconds of reducing `params` gradients over `replicas` ranks (and, under ZeRO, gathering the
    parameters back) for one iteration of `m` micro-batches; `backward`: one micro-batch's backward on the slowest
    stage, under which an overlapping implementation hides the reduction."""
    if replicas <= 1 or params == 0:
        return 0.0
    grads, weights = params * impl.grad_reduce_bytes, params * BF16
    if layout.zero_stage <= 1:
        once = _allreduce_seconds(grads, replicas, bandwidth)
        if layout.zero_stage == 1:  # reduce-scatter grads + all-gather bf16 params: half of each all-reduce
            once = 0.5 * once + 0.5 * _allreduce_seconds(weights, replicas, bandwidth)
        return max(0.0, once - (backward if impl.dp_overlap else 0.0))
    # DeepSpeed reduces (ZeRO-2) and gathers (ZeRO-3: forward and backward) on every micro-batch.
    per_micro = 0.5 * _allreduce_seconds(grads, replicas, bandwidth)
    if layout.zero_stage == 3:
        per_micro += _allreduce_seconds(weights, replicas, bandwidth)
    hidden = backward if layout.zero_stage == 2 else 0.0
    return m * max(0.0, per_micro - hidden) + 0.5 * _allreduce_seconds(weights, replicas, bandwidth)
