"""What a forward keeps on one GPU, arithmetic only: a transformer layer's stored activations in training
(Korthikanti et al. 2022), the working set of a forward without gradients, and a decoder's KV cache. The planner
(training), `inference_plan` (evaluating, sampling) and `grpo_plan` (GRPO's generation inside a training step) count
with these.
"""

from __future__ import annotations

from mtnlg_lightning.attention_kinds import cached_positions, linear_state_bytes
from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.families import kv_heads_per_rank

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def activation_bytes_per_layer(
    config: ModelConfig,
    micro_batch: int,
    tp: int,
    recompute: str,
    seq_len: int | None = None,
    sequence_parallel: bool = False,
) -> float:
    """Stored activation bytes of one transformer layer for one micro-batch (bf16), Korthikanti et al. 2022. For
    the GPT block: s·b·h·(10 + 24/t + 5·a·s/(h·t)) with TP, s·b·h·(34/t + 5·a·s/(h·t)) with TP + SP (t = 1:
    34 + 5as/h); selective recompute drops the 5as/h attention-score term; full recompute keeps only the layer input.
    The same accounting for any block: the 10 replicated s·b·h (2 norm inputs, the q/k/v and MLP inputs, 2 dropout
    masks) and, sharded over TP, q and k for QK^T, v, the projection's input, and the MLP's wide tensors (GELU: its
    input and output, 2 x F/h; SwiGLU: gate, up, silu(gate) and their product, 4 x F/h)."""
    s, b, h, a = seq_len or config.seq_len, micro_batch, config.hidden_size, config.num_heads
    hd, f = config.head_dim, config.ffn_hidden_size
    sp = sequence_parallel and tp > 1
    if recompute == "full":
        return 2 * s * b * h / (tp if sp else 1)  # only the layer input is kept
    q, kv = a * hd / tp, kv_heads_per_rank(config, tp) * hd
    mlp = (4 if config.mlp == "swiglu" else 2) * 2 * f / tp / h
    latents = 0.0
    if config.latent_attention:  # MLA: q and k (expanded), v and the core's output padded to their width
        q, kv = a * hd / tp, a * hd / tp
        latents = 4 * ((config.q_lora_rank or 0) + config.kv_lora_rank) / h  # each latent: its norm's and up's input
        latents /= tp if sp else 1  # on the sequence shard under SP
    if config.moe:  # averaged over the layers: a MoE layer's MLP in place of the dense one
        share = len(config.moe_layers) / config.num_layers
        mlp = (1 - share) * mlp + share * _moe_mlp_bytes(config, tp, sp)
    sharded = (2 * (q + kv) + 2 * kv + 2 * q) / h + mlp + latents  # GPT: 24 / t
    kept = 10 / tp + sharded if sp else 10 + sharded
    if recompute == "selective":
        return s * b * h * kept
    return s * b * h * (kept + 5 * a * s / (h * tp))


def _moe_mlp_bytes(config: ModelConfig, tp: int, sp: bool) -> float:
    """A MoE layer's stored MLP activations per token and hidden unit (bf16): each token's k routed copies (the
    gathered rows and the experts' outputs, 2 + 2 bytes) and the experts' SwiGLU tensors (4 of moe_ffn each), whole
    on every TP rank for the tokens it routes (its slice under SP, every token without); a shared expert as a
    dense SwiGLU MLP, split over TP."""
    h, k = config.hidden_size, config.experts_per_token
    routed = k * (4 + 8 * config.moe_ffn_hidden_size / h) / (tp if sp else 1)
    return routed + 8 * config.shared_expert_ffn_hidden_size / h / tp


def forward_working_bytes(config: ModelConfig, batch: int, length: int, tp: int, width: int = 2) -> tuple[float, float]:
    """(one layer, the last stage's logits): bytes a forward without gradients of `batch` x `length` tokens needs
    beside the weights and the KV cache, with `width`-byte activations: the one layer being computed (Korthikanti et
    al.'s count without the attention-score term: fused attention keeps no scores) and the fp32 logits of every
    position (vocabulary split over TP)."""
    working = activation_bytes_per_layer(config, batch, tp, "selective", seq_len=length) * width / 2
    return working, 4 * batch * length * config.padded_vocab_size(tp) / tp


def kv_cache_bytes(config: ModelConfig, layers: int, batch: int, length: float, tp: int, dtype: str = "bf16") -> float:
    """Keys and values of `layers` layers for `batch` x `length` tokens, one TP rank's key/value heads (2 x layers
    x kv_heads x head_dim x bytes per token: grouped-query attention caches only its key/value heads). Multi-head
    latent attention caches its latent and rotary key instead, whole on every TP rank ((kv_lora_rank +
    qk_rope_head_dim) x layers x bytes per token: `mla.py`). Where the layers' kinds differ (`attention_kinds`), a
    layer holds what its kind caches: a sliding layer its window, a Gated DeltaNet layer its fixed state; `layers`
    of the model's mix of kinds (the mean layer's bytes)."""
    if config.latent_attention:
        return layers * batch * length * (config.kv_lora_rank + config.qk_rope_head_dim) * DTYPE_BYTES[dtype]
    per_position = 2 * kv_heads_per_rank(config, tp) * config.head_dim * DTYPE_BYTES[dtype]
    if not config.layer_types:
        return layers * batch * length * per_position
    positions = cached_positions(config, length)
    states = sum(kind == "linear_attention" for kind in config.layer_types)
    state = linear_state_bytes(config, DTYPE_BYTES[dtype]) * states if states else 0
    return layers * batch * (sum(positions) * per_position + state) / config.num_layers
