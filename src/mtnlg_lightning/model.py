"""The decoder as a plain nn.Module: MT-NLG's GPT block or today's Llama 3 / Qwen 3 block, chosen by the config.
Parallelism is applied from outside.

Shapes: B batch, S sequence, H hidden, V padded vocabulary. The module keeps no parallel code paths: tensor
parallelism swaps its Linear/Embedding layers for sharded ones (their `out_features` shrink and the attention infers
its local head counts), pipeline parallelism deletes the parts a stage does not own (`embed`, blocks, `norm`,
`lm_head` may be None/absent), as torchtitan does.

The block (`ModelConfig`): learned positions or rotary ones (RoPE, Hugging Face's layout: the first half of each
head's dims pairs with the second, with Llama 3's frequency scaling), LayerNorm or RMSNorm, a GELU or SwiGLU MLP,
multi-head or grouped-query attention (one fused q/k/v projection laid out [heads, 3, head_dim] for multi-head,
separate q, k, v projections for grouped-query), optional q/k norms (Qwen 3), biases or none, a tied or untied LM
head.

Packed rows (`document_ids`): attention stays within each document (block-diagonal causal, `DocumentMask`, made
once per forward like `Rotary`), or within a branch and the prefix it continues (`branch_document`): SDPA with a
boolean mask, or FlexAttention with a block mask on CUDA.

Decoding passes a `KVCache` to `GPT.forward` (nanoGPT / litgpt style): the same blocks then write their keys and
values (key/value heads only) at the cache's position and attend over everything cached, so the single-process
model, a tensor-parallel shard (local heads) and a pipeline stage (its own blocks) all decode with this one forward.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from mtnlg_lightning.attention_kinds import (
    GLOBAL_ROPE,
    LOCAL_ROPE,
    AttentionSinks,
    RMSNormPlusOne,
    attention_with_sinks,
    layer_type,
    layer_window,
    rope_kind,
    window_allowed,
)
from mtnlg_lightning.biased_experts import MOE_LAYERS
from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.linear_attention import GatedDeltaNet
from mtnlg_lightning.mla import MultiHeadLatentAttention
from mtnlg_lightning.moe import Gate, MoE, StackedLinear
from mtnlg_lightning.mtp import MultiTokenPrediction
from mtnlg_lightning.sdpa import sdpa
from mtnlg_lightning.torch_compat import non_persistent_buffer_names
from mtnlg_lightning.yarn import yarn_attention_factor, yarn_inverse_frequencies


def make_norm(config: ModelConfig, dim: int) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=config.layernorm_eps)
    if config.norm == "rmsnorm_plus_one":
        return RMSNormPlusOne(dim, eps=config.layernorm_eps)
    return nn.LayerNorm(dim, eps=config.layernorm_eps, bias=config.bias)


def make_head_norm(config: ModelConfig, dim: int) -> nn.Module:
    """A q or k norm: an RMSNorm, Gemma's (1 + weight) one in a model whose norms are those."""
    if config.norm == "rmsnorm_plus_one":
        return RMSNormPlusOne(dim, eps=config.layernorm_eps)
    return nn.RMSNorm(dim, eps=config.layernorm_eps)


# ---------------------------------------------------------------------------------------------- rotary positions
def rope_scaling_of(config: ModelConfig, kind: str = GLOBAL_ROPE) -> tuple[float, dict]:
    """(base, scaling) of a RoPE kind: the sliding layers' own base takes no rope_scaling (as transformers' Gemma 3
    applies it to the full layers only)."""
    if kind == LOCAL_ROPE:
        return config.sliding_rope_theta, {}
    return config.rope_theta, config.rope_scaling or {}


def rope_inverse_frequencies(config: ModelConfig, rope: str = GLOBAL_ROPE) -> torch.Tensor:
    """theta^(-2i/d) per pair of the d rotary dims (`config.rotary_dim`: all of a head's, the first ones under
    partial rotary, MLA's decoupled rotary part), rescaled as the config's rope_scaling says (Hugging Face's
    definitions); `rope` the kind (`attention_kinds.rope_kind`: the sliding layers' own base where they have one)."""
    dim = config.rotary_dim
    theta, scaling = rope_scaling_of(config, rope)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        return yarn_inverse_frequencies(scaling, dim, theta)
    if kind == "llama3":  # long wavelengths slowed by `factor`, short ones kept, those between interpolated
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelength < original / high) * ~(wavelength > original / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, hd] rotated by the angles of its positions (cos, sin [S, rotary dims]): all of each head's
    dims, or the first ones (partial rotary: the rest pass through, as GLM-4.5 and Qwen3-Next)."""
    rotated = cos.shape[-1]
    if rotated == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turn, keep = x[..., :rotated], x[..., rotated:]
    return torch.cat((turn * cos + rotate_half(turn) * sin, keep), dim=-1)


class Rotary:
    """The rotation of one forward's positions, for every block of a model (or pipeline stage): cos, sin [S, hd]
    (or [B, 1, S, hd] for per-row `position_ids`) computed in fp32 as Hugging Face computes them, once per forward,
    for the sequence the attention sees (a sequence-parallel block's q/k projection gathers the whole sequence from
    its shards)."""

    def __init__(self, model: GPT, start: int, position_ids: torch.Tensor | None = None):
        self.model, self.start, self.position_ids = model, start, position_ids
        self._made: dict | None = None

    def __call__(self, length: int, device, dtype, rope: str = GLOBAL_ROPE) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope`: the kind of the asking layer (`attention_kinds.rope_kind`), each made once per forward."""
        key = (length, device, dtype)
        made = self._made.get(rope) if self._made is not None else None
        if made is None or made[0] != key:
            positions = self.position_ids
            if positions is None:
                positions = self.model.positions(self.start, length, device)
            freqs = positions.float()[..., None] * self.model.rope_inverse_frequencies(device, rope)
            angles = torch.cat((freqs, freqs), dim=-1)
            if angles.dim() == 3:  # [B, S, hd]: one row of positions per sequence, broadcast over the heads
                angles = angles.unsqueeze(1)
            _, scaling = rope_scaling_of(self.model.config, rope)
            factor = yarn_attention_factor(scaling)  # YaRN's, on cos and sin in fp32 as HF's; 1 for the others
            cos, sin = angles.cos(), angles.sin()
            if factor != 1.0:
                cos, sin = cos * factor, sin * factor
            made = (key, cos.to(dtype), sin.to(dtype))
            self._made = {**(self._made or {}), rope: made}
        return made[1], made[2]


# ---------------------------------------------------------------------------------------------- document masks
# The keyword inputs of `GPT.forward` a batch may carry besides its tokens (every layout passes them on by name).
MODEL_INPUTS = ("position_ids", "document_ids")
MASK_KERNELS = ("auto", "sdpa", "flex", "blocks")


# A branch continues a shared prefix document: its tokens see the prefix's (earlier) tokens and their own, not the
# other branches'. GRPO trains a prompt's completions as branches of the prompt, which is computed once
# (`train/objectives/rollouts.shared_prompt_rows`). Branch `j` of document `d` has the id -(2 + d x BRANCHES + j): the
# ids below PADDING_DOCUMENT (-1), so plain documents (0, 1, ...) and the padding keep their meaning.
BRANCHES = 1 << 16


def branch_document(prefix: int, branch: int) -> int:
    """The document id of `branch` (0-based, < BRANCHES) continuing document `prefix` (>= 0)."""
    return -(2 + prefix * BRANCHES + branch)


def seen_prefix(document_ids: torch.Tensor) -> torch.Tensor:
    """Each id's prefix document: the one a branch continues, the id itself for any other document."""
    return torch.where(document_ids < -1, (-document_ids - 2) // BRANCHES, document_ids)


def document_mask(
    document_ids: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None = None
):
    """[B, 1, Lq, Lk] bool: query i may see key j iff j <= i (positions in the whole sequence) and both lie in the
    same document, or key j in the prefix that query i's branch continues (`document_ids` [B, S] of the whole
    sequence); with a `window` (a sliding layer's), only if j > i - window too."""
    queries, keys = document_ids[:, query_positions], document_ids[:, key_positions]
    causal = window_allowed(query_positions, key_positions, window)
    same = (queries[:, :, None] == keys[:, None, :]) | (seen_prefix(queries)[:, :, None] == keys[:, None, :])
    return (causal & same).unsqueeze(1)


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)


class DocumentMask:
    """Block-diagonal causal attention of packed rows: `document_ids` [B, S] (tokens of one document share an id)
    for every block of a model (or pipeline stage), built once per forward for the sequence the attention sees (a
    sequence-parallel block gathers the whole of it). `kernel`: sdpa (a dense boolean mask), flex (FlexAttention's
    block mask, which skips the blocks of keys no query sees), blocks (nothing built: context parallelism's ring
    slices `document_ids` for each of its blocks), auto (flex on CUDA, sdpa elsewhere). `window`: a sliding
    layer's band on top (`attention_kinds`); `for_window` gives each layer kind's mask, each made once."""

    def __init__(self, document_ids: torch.Tensor, kernel: str = "auto", window: int | None = None):
        if kernel not in MASK_KERNELS:
            raise MTNLGError(f"document mask kernel {kernel!r} is not one of {', '.join(MASK_KERNELS)}")
        if kernel == "auto":
            kernel = "flex" if document_ids.is_cuda else "sdpa"
        self.document_ids, self.kernel, self.window = document_ids, kernel, window
        self.one_sequence = False  # `CausalMasks`' (a row that is one document: context parallelism rebuilds it)
        self.dense = self.block_mask = None
        self._windowed: dict[int | None, DocumentMask] = {window: self}
        B, S = document_ids.shape
        if kernel == "sdpa":
            self.dense = self.allowed()
        elif kernel == "flex":
            prefixes = seen_prefix(document_ids)
            band = window if window is not None else S + 1  # a band wider than the sequence: no band

            def same_document_causal(b, h, q, k):
                key = document_ids[b, k]
                return (k <= q) & (k > q - band) & ((document_ids[b, q] == key) | (prefixes[b, q] == key))

            self.block_mask = create_block_mask(same_document_causal, B, None, S, S, device=document_ids.device)

    def allowed(self) -> torch.Tensor:
        """The dense boolean mask [B, 1, S, S] (what SDPA takes; a sink layer's scores are masked with it)."""
        if self.dense is not None:
            return self.dense
        positions = torch.arange(self.document_ids.shape[1], device=self.document_ids.device)
        return document_mask(self.document_ids, positions, positions, self.window)

    def for_window(self, window: int | None, length: int, device=None) -> DocumentMask:
        """This mask with a sliding layer's `window` instead (the same documents and kernel); `length` unused: the
        documents say the sequence's and where it is."""
        if window not in self._windowed:
            self._windowed[window] = DocumentMask(self.document_ids, self.kernel, window)
            self._windowed[window]._windowed = self._windowed
        return self._windowed[window]

    def attend(self, q, k, v, dropout_p: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(QK^T / sqrt(d) + mask) V over the whole sequence, grouped-query heads expanded as `attention`;
        with `sinks` (a sink layer's, [heads]) their column joins the softmax (`attention_with_sinks`)."""
        groups = q.shape[1] // k.shape[1]
        if sinks is not None and self.kernel == "flex":  # FlexAttention takes no sink column: the exact dense path
            return attention_with_sinks(q, k, v, self.allowed(), sinks, dropout_p)
        if self.kernel == "flex":
            if dropout_p:
                raise MTNLGError("FlexAttention has no attention dropout: set attention_dropout to 0 for packed rows")
            # Compiled on CUDA (the fused kernel); eager elsewhere (an unfused reference, forward only on CPU).
            flex = _compiled_flex_attention() if q.is_cuda else flex_attention
            return flex(q, k, v, block_mask=self.block_mask, enable_gqa=groups > 1)
        if self.dense is None:
            raise MTNLGError(f"a document mask built for {self.kernel!r} has no dense mask to attend with")
        if sinks is not None:
            return attention_with_sinks(q, k, v, self.dense, sinks, dropout_p)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return sdpa(q, k, v, attn_mask=self.dense, dropout_p=dropout_p)


class CausalMasks:
    """The masks of a row that is one sequence (no `document_ids`) in a model with sliding layers: full layers
    attend causally (no mask), a sliding layer through a `DocumentMask` of one document with its window, made once
    per forward for the length the attention sees."""

    def __init__(self, kernel: str = "auto"):
        self.kernel = kernel
        self._made: dict[tuple, DocumentMask] = {}

    def for_window(self, window: int | None, length: int, device=None) -> DocumentMask | None:
        if window is None:
            return None
        key = (window, length, device)
        if key not in self._made:
            one_document = torch.zeros(1, length, dtype=torch.long, device=device)
            self._made[key] = DocumentMask(one_document, self.kernel, window)
            self._made[key].one_sequence = True
        return self._made[key]


# ---------------------------------------------------------------------------------------------- the block
class Attention(nn.Module):
    """Self-attention; its subclass, chosen once by `make_attention`, says how the input becomes q, k and v.
    `index`: its layer, whose kind (`attention_kinds`: full or sliding, its RoPE base) is fixed here."""

    def __init__(self, config: ModelConfig, index: int = 0):
        super().__init__()
        self.head_dim = config.head_dim
        heads, kv_heads, hd, h = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
        self.make_projections(config)  # first: the parameters' order (and the init's draws) is q/k/v, proj, norms
        self.proj = nn.Linear(heads * hd, h, bias=config.attention_output_bias)
        # q/k norms: None, over each head's dims (Qwen 3) or over the whole projection (OLMoE)
        self.qk_norm_over = config.qk_norm_over if config.qk_norm else None
        if self.qk_norm_over is not None:
            whole = self.qk_norm_over == "projection"
            self.q_norm = make_head_norm(config, heads * hd if whole else hd)
            self.k_norm = make_head_norm(config, kv_heads * hd if whole else hd)
        self.sinks = AttentionSinks(heads) if config.attention_sinks else None
        self.output_gate = bool(config.attention_output_gate)  # Qwen3-Next: q's projection is [query, gate] per head
        self.window, self.rope_kind = layer_window(config, index), rope_kind(config, index)
        # A softmax scale other than head_dim^-0.5 (Gemma 3's) multiplies q once: every kernel then applies its own.
        scale = config.attention_softmax_scale
        self.query_scale = 1.0 if scale is None else scale * math.sqrt(hd)
        self.dropout = config.attention_dropout
        # Swappable so activation checkpointing can recompute just the attention core (Megatron's selective).
        self.core = AttentionCore()

    def make_projections(self, config: ModelConfig) -> None:
        """The q, k and v projections."""
        raise NotImplementedError

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, S, heads, hd], k and v [B, S, kv_heads, hd] of this rank's heads."""
        raise NotImplementedError

    def project(self, x: torch.Tensor):
        """q [B, heads, S, hd], k and v [B, kv_heads, S, hd] (this rank's heads), and the output gate [B, S, heads x
        hd] where the attention has one (else None)."""
        q, k, v = self.split_heads(x)
        gate = None
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(*gate.shape[:2], -1)
        if self.qk_norm_over == "head":  # before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.qk_norm_over == "projection":
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary | None = None,
        cache: LayerCache | None = None,
        mask: DocumentMask | None = None,
    ) -> torch.Tensor:
        q, k, v, gate = self.project(x)
        if rotary is not None:
            cos, sin = rotary(q.shape[2], q.device, q.dtype, self.rope_kind)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        if mask is not None:  # the mask of this layer's kind: its window, if it slides
            mask = mask.for_window(self.window, q.shape[2], q.device)
        sinks = () if self.sinks is None else (self.sinks.weight,)
        if cache is None:
            y = self.core(q, k, v, self.dropout if self.training else 0.0, mask, *sinks)
        elif self.window is None and self.sinks is None:
            # decoding: the new positions attend to every cached one; a prefill (start 0) is causal
            k, v = cache.update(k, v)
            y = attention(q, k, v, causal=q.shape[2] > 1)
        else:  # decoding a sliding or sink layer: its window's keys only, the sinks' column in the softmax
            start = cache.cache.start
            k, v, key_positions = cache.update_window(k, v, self.window)
            queries = torch.arange(start, start + q.shape[2], device=q.device)
            allowed = window_allowed(queries, key_positions, self.window)
            y = attention_with_sinks(q, k, v, allowed, *sinks) if sinks else attention(q, k, v, mask=allowed)
        B, _, S, _ = y.shape
        y = y.transpose(1, 2).reshape(B, S, -1)
        return self.proj(y if gate is None else y * torch.sigmoid(gate))


class FusedQKVAttention(Attention):
    """Multi-head attention with one q/k/v projection, rows laid out [heads, 3, head_dim]: a contiguous column shard
    holds whole heads (GPT, MT-NLG)."""

    def make_projections(self, config: ModelConfig) -> None:
        width = 3 * config.num_heads * config.head_dim
        self.qkv = nn.Linear(config.hidden_size, width, bias=config.qkv_bias)

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv(x)
        B, S, _ = qkv.shape  # from the projection: a sequence-parallel qkv receives a slice and gathers it
        q, k, v = qkv.view(B, S, -1, 3, self.head_dim).unbind(dim=3)  # -1: heads held by this rank
        return q, k, v


class GroupedQueryAttention(Attention):
    """Separate q, k and v projections: the key/value heads split (or replicated) over TP apart from the query
    heads (Llama, Qwen, the mixtures of experts)."""

    def make_projections(self, config: ModelConfig) -> None:
        heads, kv_heads, hd, h = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
        gated = 2 if config.attention_output_gate else 1  # each head's [query, gate] (Qwen3-Next)
        self.q = nn.Linear(h, heads * hd * gated, bias=config.qkv_bias)
        self.k = nn.Linear(h, kv_heads * hd, bias=config.qkv_bias)
        self.v = nn.Linear(h, kv_heads * hd, bias=config.qkv_bias)

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.q(x), self.k(x), self.v(x)
        B, S, _ = q.shape
        q = q.view(B, S, -1, self.head_dim * (2 if self.output_gate else 1))
        return q, *(t.view(B, S, -1, self.head_dim) for t in (k, v))


def make_attention(config: ModelConfig, index: int = 0) -> nn.Module:
    """Layer `index`'s token mixer: attention (multi-head latent attention, `mla.py`, given the swappable core every
    attention has), or Gated DeltaNet in a linear_attention layer."""
    if layer_type(config, index) == "linear_attention":
        return GatedDeltaNet(config, index)
    if config.latent_attention:
        return MultiHeadLatentAttention(config, AttentionCore())
    return FusedQKVAttention(config, index) if config.fused_qkv else GroupedQueryAttention(config, index)


def attention(q, k, v, dropout_p: float = 0.0, causal: bool = True, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(QK^T / sqrt(d)) V; each key/value head serves its group of query heads (grouped-query attention).
    `mask`: a boolean [Lq, Lk] of the keys each query sees, in place of causal (a sliding layer's window)."""
    groups = q.shape[1] // k.shape[1]
    if mask is not None:
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    if groups > 1 and not causal:
        # Every query sees every key (a decoding step): a group's query heads become rows of one query of their
        # key/value head, so the cache is read as it is instead of copied `groups` times per token.
        B, H, L, D = q.shape
        grouped = q.reshape(B, k.shape[1], groups * L, D)
        y = sdpa(grouped, k, v, dropout_p=dropout_p)
        return y.view(B, H, L, D)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return sdpa(q, k, v, dropout_p=dropout_p, is_causal=causal)


class AttentionCore(nn.Module):
    """Causal attention; flash/memory-efficient kernels where available; within documents (and a sliding layer's
    window) given a `mask`; with a sink layer's `sinks` [heads], their column in the softmax."""

    def forward(self, q, k, v, dropout_p: float = 0.0, mask: DocumentMask | None = None, sinks=None):
        if mask is not None:
            return mask.attend(q, k, v, dropout_p, sinks)
        if sinks is not None:
            causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
            return attention_with_sinks(q, k, v, causal, sinks, dropout_p)
        return attention(q, k, v, dropout_p)


class GeluMLP(nn.Module):
    """fc2(gelu(fc1(x))), GELU's tanh form (GPT, MT-NLG). `width`: the hidden width if not ffn_hidden_size."""

    def __init__(self, config: ModelConfig, width: int | None = None):
        super().__init__()
        h, f = config.hidden_size, width or config.ffn_hidden_size
        self.fc1 = nn.Linear(h, f, bias=config.bias)
        self.fc2 = nn.Linear(f, h, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Llama, Qwen). `width`: the hidden width if not ffn_hidden_size (a mixture of
    experts' shared expert)."""

    def __init__(self, config: ModelConfig, width: int | None = None):
        super().__init__()
        h, f = config.hidden_size, width or config.ffn_hidden_size
        self.gate = nn.Linear(h, f, bias=config.bias)
        self.up = nn.Linear(h, f, bias=config.bias)
        self.down = nn.Linear(f, h, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GeGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x)) (Gemma's gelu_pytorch_tanh MLP): SwiGLU's modules, GELU's tanh form."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


DENSE_MLPS = {"gelu": GeluMLP, "swiglu": SwiGLU, "geglu": GeGLU}  # by `ModelConfig.mlp`


def make_mlp(config: ModelConfig, index: int) -> nn.Module:
    """Block `index`'s MLP: dense, or a mixture of experts (`moe.py`) where the config says."""
    dense = DENSE_MLPS[config.mlp]
    if not config.is_moe_layer(index):
        return dense(config)
    shared = config.shared_expert_ffn_hidden_size
    return MOE_LAYERS[config.expert_mlp](config, dense(config, shared) if shared else None)


class Block(nn.Module):
    """Pre-norm transformer block; `index` its layer (which says whether its MLP is a mixture of experts, and its
    attention's kind). `post_block_norms` (Gemma's): the attention's and the MLP's outputs normed too, before each
    residual add (`post_attn_norm`, `post_mlp_norm`; `ln2` is then Gemma's pre-feed-forward norm)."""

    def __init__(self, config: ModelConfig, index: int = 0):
        super().__init__()
        self.ln1 = make_norm(config, config.hidden_size)
        self.attn = make_attention(config, index)
        if config.post_block_norms:
            self.post_attn_norm = make_norm(config, config.hidden_size)
        self.ln2 = make_norm(config, config.hidden_size)
        self.mlp = make_mlp(config, index)
        if config.post_block_norms:
            self.post_mlp_norm = make_norm(config, config.hidden_size)
        else:  # chosen here: identities where the block has no such norms
            self.post_attn_norm = self.post_mlp_norm = nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor, rotary=None, cache=None, mask=None) -> torch.Tensor:
        """rotary, cache, mask: the attention's (`Attention.forward`)."""
        x = x + self.dropout(self.post_attn_norm(self.attn(self.ln1(x), rotary, cache, mask)))
        return x + self.dropout(self.post_mlp_norm(self.mlp(self.ln2(x))))


class Embedding(nn.Module):
    """The word embedding (positions enter the attention: RoPE)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(config.padded_vocab_size(), config.hidden_size)
        self.make_positions(config)
        self.dropout = nn.Dropout(config.hidden_dropout)
        # Gemma's: the embedding times sqrt(hidden_size), the factor rounded to the weights' dtype first (as HF's)
        self.scale = math.sqrt(config.hidden_size) if config.scale_embeddings else None

    def scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.scale is None else h * torch.tensor(self.scale, dtype=h.dtype, device=h.device)

    def make_positions(self, config: ModelConfig) -> None:
        """A position table, where positions enter here."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.scaled(self.wte(tokens)))


class LearnedPositionEmbedding(Embedding):
    """The word embedding plus a learned position table (GPT, MT-NLG)."""

    def make_positions(self, config: ModelConfig) -> None:
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.scaled(self.wte(tokens)) + self.wpe(positions))


EMBEDDINGS = {"learned": LearnedPositionEmbedding, "rope": Embedding}  # by `ModelConfig.position_embedding`


class OutputHead(nn.Linear):
    """The LM head: an `nn.Linear` (same parameter, same keys) that can also hand its weight to a function run
    inside its own call (`within`): the loss that applies the head in chunks (`parallel/output_layer.py`) runs in one
    call of this module, so that hooks on module calls (ZeRO-3 gathering the weight) fire once per micro-batch on
    every rank, however many chunks each rank's counted labels make."""

    def forward(self, h: torch.Tensor, within=None) -> torch.Tensor:
        return within(self.weight) if within is not None else super().forward(h)


class GPT(nn.Module):
    # How packed rows are masked (`DocumentMask`): auto (FlexAttention on CUDA, SDPA with a dense mask elsewhere);
    # context parallelism sets "blocks" (its ring masks block by block); tests set "flex" to run it on CPU.
    document_mask_kernel = "auto"
    # Set while a training step's runner runs (`output_layer.heads_in_loss`): forward stops at the final norm and
    # the loss applies the head, in chunks (`parallel/output_layer.py`); decoding with a cache still gets logits.
    head_in_loss = False
    # Whether a forward outside training runs the multi-token prediction depths too (their outputs wait for the
    # loss: `mtp.MultiTokenPrediction.take`); decoding with a cache never does.
    predict_ahead = False
    # Context parallelism's (`parallel/context_parallel.py`): whole rows [B, S] -> this rank's chunks; None without.
    # The multi-token prediction depths take the tokens k ahead of this rank's positions from the whole rows.
    sequence_chunks = None

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = EMBEDDINGS[config.position_embedding](config)
        # A dict keeps parameter names stable when pipeline stages delete the blocks they do not own.
        self.blocks = nn.ModuleDict({str(i): Block(config, i) for i in range(config.num_layers)})
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head = OutputHead(config.hidden_size, config.padded_vocab_size(), bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.wte.weight
        # DeepSeek-V3's multi-token prediction depths (`mtp.py`): run in training forwards only, or `predict_ahead`
        self.mtp = MultiTokenPrediction(config, Block, make_norm) if config.mtp_layers else None
        # RoPE's frequencies in fp32 whatever dtype the model is cast to (not a buffer, which `.to(bf16)` would round).
        self._rope_inv_freq: dict[str, torch.Tensor] | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Megatron init: N(0, std) everywhere (std sqrt(1/3H) for MT-NLG, the family's 0.02 for Llama / Qwen),
        output projections scaled by 1/sqrt(2 * num_layers) (as Megatron and torchtitan initialise both)."""
        std = self.config.init_std
        out_std = std / math.sqrt(2.0 * self.config.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scaled = name.endswith(("attn.proj", "mlp.fc2", "mlp.down", "shared.down"))
                nn.init.normal_(module.weight, mean=0.0, std=out_std if scaled else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, StackedLinear | Gate):  # experts and routers (mixture-of-experts blocks)
                scaled = name.endswith("experts.down")
                nn.init.normal_(module.weight, mean=0.0, std=out_std if scaled else std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNormPlusOne):  # (1 + weight): the identity scale at 0
                nn.init.zeros_(module.weight)
            elif isinstance(module, AttentionSinks):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, MoE) and module.expert_bias is not None:  # a sigmoid router's: balanced
                module.expert_bias.zero_()

    def positions(self, start: int, length: int, device) -> torch.Tensor:
        """The positions of `length` tokens starting at `start` (context parallelism replaces this: a rank holds
        chunks of the sequence, not a contiguous run)."""
        return torch.arange(start, start + length, device=device)

    def rope_inverse_frequencies(self, device, rope: str = GLOBAL_ROPE) -> torch.Tensor:
        """The frequencies of RoPE kind `rope` (`attention_kinds.rope_kind`) on `device`, made once."""
        made = self._rope_inv_freq or {}
        if rope not in made or made[rope].device != device:
            self._rope_inv_freq = {**made, rope: rope_inverse_frequencies(self.config, rope).to(device)}
        return self._rope_inv_freq[rope]

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, S] int64 (or hidden states [B, S, H] on a pipeline stage without `embed`) -> logits [B, S, V]
        (the final hidden states [B, S, H] where the head is in the loss, `head_in_loss`).
        `position_ids` [B, S]: each token's position (the data's; packed documents restart theirs); None: 0..S-1.
        `document_ids` [B, S]: the document of each token of a packed row; attention stays within it. None: the
        row is one sequence (plain causal attention).
        With a `cache`, the tokens sit at positions cache.start.. and their keys and values are cached; decoding
        needs only the last position's logits, so only it goes through the LM head ([B, 1, V], as nanoGPT).
        `mtp_tokens` [B, S]: the whole rows' tokens for the multi-token prediction depths, where `tokens` are not
        (a last pipeline stage's hidden states; context parallelism's chunks)."""
        start = cache.start if cache is not None else 0
        positions = None
        if self.embed is not None:
            positions = position_ids
            if positions is None:
                positions = self.positions(start, tokens.shape[1], tokens.device)
            h = self.embed(tokens, positions)
        else:
            h = tokens
        rotary = Rotary(self, start, position_ids) if self.config.position_embedding == "rope" else None
        if document_ids is not None and cache is not None:
            raise MTNLGError("document_ids are for training and scoring packed rows, not for decoding with a cache")
        mask = None
        kernel = self.document_mask_kernel
        if kernel == "auto" and self.training and self.config.attention_dropout:
            kernel = "sdpa"  # FlexAttention has no attention dropout
        if document_ids is not None:
            mask = DocumentMask(document_ids, kernel)
        elif self.config.sliding_window is not None and cache is None:
            mask = CausalMasks(kernel)  # the sliding layers' windows (full layers: plain causal attention)
        for name, block in self.blocks.items():
            h = block(h, rotary, cache.layer(name)) if cache is not None else block(h, rotary, mask=mask)
        if cache is not None and self.lm_head is not None:
            h = h[:, -1:]
        if self.norm is not None:
            h = self.norm(h)
        if self.mtp is not None and cache is None and (self.training or self.predict_ahead):
            if positions is None:  # a stage without the embedding: the data's positions, or 0..S-1
                positions = position_ids if position_ids is not None else self.positions(0, h.shape[1], h.device)
            whole = mtp_tokens if mtp_tokens is not None else tokens if self.embed is not None else None
            self._predict_ahead(h, whole, positions, rotary, mask, document_ids)
        elif self.mtp is not None:
            self.mtp.forget_routing()
        if self.lm_head is None or (self.head_in_loss and cache is None):
            # A pipeline stage's output travels to the next stage, whose buffers are contiguous.
            return h.contiguous()
        return self.lm_head(h)

    def _predict_ahead(self, h, tokens, positions, rotary, mask, document_ids) -> None:
        """Run the multi-token prediction depths on the final hidden states `h` (`mtp.MultiTokenPrediction`): with
        this model's embedding, or on a last pipeline stage the depths' copy of it (`pipeline.build_stage`)."""
        if tokens is None:
            raise MTNLGError("multi-token prediction on a pipeline stage without the embedding needs mtp_tokens")
        embed = self.embed if self.embed is not None else self.mtp.embed
        head = None if self.head_in_loss else self.lm_head
        self.mtp.predict(embed, head, h, tokens, positions, rotary, mask, document_ids, self.sequence_chunks)


class KVCache:
    """Keys and values of a model's (or a pipeline stage's) blocks for up to `length` positions, allocated at a
    block's first use with the shape its attention produces (local key/value heads under tensor parallelism: a
    grouped-query model caches only its key/value heads; a sliding layer only its window's positions, a ring:
    `LayerCache.update_window`). The caller sets `start`, the position of the next tokens, before each forward."""

    def __init__(self, length: int):
        self.length, self.start = length, 0
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}
        # Gated DeltaNet layers' decode state instead of keys and values: {"conv": [B, C, kernel - 1], "state":
        # [B, n_v, d_k, d_v] fp32} per layer, a constant size whatever the length (`linear_attention.py`)
        self.states: dict[str, dict[str, torch.Tensor]] = {}

    def layer(self, name: str) -> LayerCache:
        return LayerCache(self, name)

    def expand_rows(self, rows: torch.Tensor) -> None:
        """Row i of the cache becomes the old row `rows[i]`: a prefill made once per distinct prompt serves every
        row that continues it (GRPO's G completions of a prompt)."""
        for store in (self.keys, self.values, *self.states.values()):
            for name, tensor in store.items():
                store[name] = tensor.index_select(0, rows.to(tensor.device))

    def bytes_per_position(self) -> int:
        """Bytes one position takes in every block that caches every position: blocks x kv_heads x (key + value
        head dims) x element size (multi-head latent attention's: its latent and rotary key, `mla.py`; a sliding
        layer's cache holds its window, whatever the length: `bytes_held`)."""
        return sum(
            t[0, :, 0].numel() * t.element_size()
            for name, keys in self.keys.items()
            if keys.shape[2] == self.length
            for t in (keys, self.values[name])
        )

    def bytes_held(self) -> int:
        """Bytes the cache holds: every block's keys and values (a sliding layer's window of them), and the Gated
        DeltaNet layers' states."""
        states = sum(t.numel() * t.element_size() for held in self.states.values() for t in held.values())
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values())) + states


class LayerCache:
    """One block's view of a `KVCache`."""

    def __init__(self, cache: KVCache, name: str):
        self.cache, self.name = cache, name

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, kv_heads, S, hd] at positions start..start+S (v's hd may differ from k's); return every
        cached position up to there."""
        c = self.cache
        start, end = c.start, c.start + k.shape[2]
        if k.shape[2] > 1 and start:
            raise ValueError("several new positions at once only from position 0 (the prefill)")
        if end > c.length:
            raise ValueError(f"position {end} is beyond the cache's {c.length}")
        if self.name not in c.keys:
            shape = (k.shape[0], k.shape[1], c.length)
            c.keys[self.name] = k.new_empty((*shape, k.shape[3]))
            c.values[self.name] = v.new_empty((*shape, v.shape[3]))
        keys, values = c.keys[self.name], c.values[self.name]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def update_window(self, k: torch.Tensor, v: torch.Tensor, window: int | None):
        """`update` for a layer that sees at most its last `window` keys (None: all): it caches only those, position
        p in slot p % window (a ring: a decoding step overwrites the position that left the window). Returns the
        keys and values to attend to and their positions [L] (softmax does not mind their order; the caller masks
        by position)."""
        c = self.cache
        start, end = c.start, c.start + k.shape[2]
        if window is None or window >= c.length:
            keys, values = self.update(k, v)
            return keys, values, torch.arange(end, device=k.device)
        if k.shape[2] > 1 and start:
            raise ValueError("several new positions at once only from position 0 (the prefill)")
        if end > c.length:
            raise ValueError(f"position {end} is beyond the cache's {c.length}")
        if self.name not in c.keys:
            shape = (k.shape[0], k.shape[1], window, k.shape[3])
            c.keys[self.name], c.values[self.name] = k.new_empty(shape), v.new_empty(shape)
        keys, values = c.keys[self.name], c.values[self.name]
        kept = torch.arange(max(start, end - window), end, device=k.device)  # the new positions still in the window
        keys[:, :, kept % window] = k[:, :, kept - start]
        values[:, :, kept % window] = v[:, :, kept - start]
        if k.shape[2] > 1:  # the prefill attends to all its own keys
            return k, v, torch.arange(start, end, device=k.device)
        slots = torch.arange(min(end, window), device=k.device)
        return keys[:, :, : slots.numel()], values[:, :, : slots.numel()], end - 1 - (end - 1 - slots) % window


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """torch.compile every transformer block, one by one (as torchtitan does): the blocks are identical, so one
    compiled graph serves them all, and whatever wraps or shards a block's layers afterwards is traced as it is
    at its first call (compilation is lazy): tensor/sequence parallelism, pipeline pruning, activation
    checkpointing. Returns the number of blocks compiled. `backend`: inductor (generated kernels: the speed),
    aot_eager (traced forward and backward, no code generation: checks composition quickly), eager."""
    if backend not in COMPILE_BACKENDS:
        raise MTNLGError(f"model.compile_backend {backend!r} is not one of {', '.join(COMPILE_BACKENDS)}")
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)


def build_model(config: ModelConfig, device: str | torch.device | None = None) -> GPT:
    """Build on `device`; on "meta" nothing is allocated (used to size the 530B model)."""
    with torch.device(device or "cpu"):
        return GPT(config)


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the model's persistent buffers: state that is not trained by gradients (a sigmoid
    router's expert bias), saved and loaded with the weights under its module path."""
    return [
        (f"{prefix}.{name}" if prefix else name, buffer)
        for prefix, module in model.named_modules()
        for name, buffer in module.named_buffers(recurse=False)
        if name not in non_persistent_buffer_names(module)
    ]
