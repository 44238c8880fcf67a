"""Attention beyond full causal, chosen per layer when the model is built (`ModelConfig.layer_types`, Hugging Face's):
- `full_attention`: causal over every earlier key (of its document, in a packed row);
- `sliding_attention`: causal over the last `sliding_window` keys only, the query's own included (Hugging Face's
  `kv_idx > q_idx - sliding_window`), so a sliding layer's mask is the document mask with a band
  (`model.DocumentMask`, dense SDPA, FlexAttention and context parallelism's ring alike);
- per-kind RoPE: the sliding layers may have their own base (`sliding_rope_theta`, Gemma 3's local base, without the
  full layers' `rope_scaling`, as transformers applies it);
- learned attention sinks (`attention_sinks`, GPT-OSS): one logit per head that joins each query's softmax as an
  extra column and takes its share of the probability mass, with no value (`p_ij = exp(s_ij) / (sum_j' exp(s_ij')
  + exp(sink_h))`: rows may sum to less than 1). SDPA and FlexAttention take no such column, so a sink layer
  attends through `attention_with_sinks`: the scores materialised (fp32 where the inputs are), exact, O(S^2)
  memory per head, as transformers' eager path computes it.

Also here, as a piece the families that use these kinds need: Gemma's (1 + weight) RMSNorm (YaRN, which GPT-OSS
uses, is `yarn.py`). Nothing here imports the model: `model.py` builds from these.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtnlg_lightning.errors import MTNLGError

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
LAYER_TYPES = (FULL, SLIDING, LINEAR)  # linear: Gated DeltaNet (`linear_attention.py`)
LINEAR_FIELDS = (
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim",
)  # fmt: skip
# RoPE kinds: every layer rotates with the model's base ("global") unless the sliding layers have their own ("local").
GLOBAL_ROPE, LOCAL_ROPE = "global", "local"


def check_attention_kinds(config) -> None:
    """A layer pattern the block can run (one line otherwise): one known kind per layer, a window where a layer
    slides, and, in a custom block, a window that matters (smaller than seq_len: a window as long as the sequence
    is full attention; a family's window is its checkpoint's, and training it on shorter rows is no mistake)."""
    types = config.layer_types
    if types is not None:
        if not isinstance(types, list | tuple) or len(types) != config.num_layers:
            count = len(types) if isinstance(types, list | tuple) else types
            raise MTNLGError(f"layer_types lists {count} layer kinds for a {config.num_layers}-layer model")
        unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
        if unknown:
            raise MTNLGError(f"layer_types has {unknown[0]!r}, not one of {', '.join(LAYER_TYPES)}")
    sliding = types is not None and SLIDING in types
    window = config.sliding_window
    if sliding and not (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
        raise MTNLGError(f"sliding_attention layers need sliding_window >= 1 (the keys a query sees), got {window!r}")
    if sliding and window >= config.seq_len and config.family is None:  # a family's window is its checkpoint's
        raise MTNLGError(
            f"sliding_window {window} is not smaller than seq_len {config.seq_len}: no query would lose a key; "
            f"lower it, or list those layers as full_attention"
        )
    if config.sliding_rope_theta is not None and not sliding:
        raise MTNLGError("sliding_rope_theta is the sliding layers' RoPE base, and no layer is sliding_attention")
    if types is not None and LINEAR in types:
        missing = [f for f in LINEAR_FIELDS if not (isinstance(getattr(config, f), int) and getattr(config, f) >= 1)]
        if missing:
            raise MTNLGError(f"linear_attention layers need {', '.join(missing)} (integers >= 1)")
        if config.linear_num_value_heads % config.linear_num_key_heads:
            raise MTNLGError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    factor = config.partial_rotary_factor
    if not (isinstance(factor, int | float) and 0 < factor <= 1 and int(config.head_dim * factor) % 2 == 0):
        raise MTNLGError(f"partial_rotary_factor {factor!r} must be in (0, 1] and rotate an even number of dims")
    scale = config.attention_softmax_scale
    if scale is not None and not (isinstance(scale, int | float) and 0 < scale < math.inf):
        raise MTNLGError(f"attention_softmax_scale must be a positive number or null, got {scale!r}")


def layer_type(config, index: int) -> str:
    return FULL if config.layer_types is None else config.layer_types[index]


def layer_window(config, index: int) -> int | None:
    """The keys layer `index`'s queries see (None: all earlier ones)."""
    return config.sliding_window if layer_type(config, index) == SLIDING else None


def rope_kind(config, index: int) -> str:
    """Which RoPE layer `index` rotates with: the sliding layers' own base where they have one, else the model's."""
    own = config.sliding_rope_theta is not None and layer_type(config, index) == SLIDING
    return LOCAL_ROPE if own else GLOBAL_ROPE


def rope_kinds(config) -> tuple[str, ...]:
    return tuple(sorted({rope_kind(config, i) for i in range(config.num_layers)}))


def cached_positions(config, length: float) -> list[float]:
    """The positions each layer's decode cache holds after `length` tokens: all of them (full), its window at
    most (sliding: `model.LayerCache.update_window`), none (Gated DeltaNet: a state instead, `linear_state_bytes`)."""
    kinds = config.layer_types or [FULL] * config.num_layers
    return [
        0.0 if kind == LINEAR else min(length, config.sliding_window) if kind == SLIDING else length for kind in kinds
    ]


def linear_state_bytes(config, dtype_bytes: int) -> int:
    """One row's decode state in one Gated DeltaNet layer, whatever the length: the convolution's last kernel - 1
    inputs (the model's dtype) and the recurrent state [n_v, d_k, d_v] in fp32."""
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    return (config.linear_conv_kernel_dim - 1) * (2 * nk * dk + nv * dv) * dtype_bytes + nv * dk * dv * 4


def window_allowed(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Lq, Lk] bool: key j is causal for query i and, with a window, among its last `window` keys."""
    allowed = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        allowed = allowed & (key_positions[None, :] > query_positions[:, None] - window)
    return allowed


# ---------------------------------------------------------------------------------------------- sinks
def attention_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor, dropout_p: float = 0
) -> torch.Tensor:
    """softmax over [QK^T / sqrt(d) (masked), sink_h] without the sink's column, times V: q [B, H, Lq, d], k and v
    [B, KV, Lk, d] (each key/value head serving its group of query heads), `allowed` bool broadcastable to
    [B, H, Lq, Lk], `sinks` [H] (this rank's heads). Every query sees at least its own key, so no row is empty."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    # the row maximum first, as transformers does (no overflow in bf16 / fp16), then the softmax in the scores' dtype
    combined = combined - combined.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    probs = F.dropout(probs, p=dropout_p) if dropout_p else probs
    return torch.matmul(probs.to(v.dtype), v)


class AttentionSinks(nn.Module):
    """The learned sink logit of each attention head ([heads]; a tensor-parallel rank holds its heads')."""

    def __init__(self, heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(heads))


# ---------------------------------------------------------------------------------------------- norms
class RMSNormPlusOne(nn.Module):
    """Gemma's RMSNorm: x / rms(x) in fp32, times (1 + weight) in fp32, cast back; the weight starts at 0 (the
    identity scale)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)
