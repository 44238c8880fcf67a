"""Multi-head latent attention (MLA; DeepSeek-V2 and V3, Kimi K2), chosen by `ModelConfig.kv_lora_rank`.

Keys and values come up from a compressed latent: `kv_down` (x -> kv_lora_rank) and its RMSNorm, then `kv_up`
(latent -> each head's key part without rotation, qk_nope_head_dim, and its value, v_head_dim). The rotary part of
the keys is one head shared by every query head: `k_rope` (x -> qk_rope_head_dim), rotated. Queries come from x
through `q`, or through a latent of their own (`q_down`, its norm, `q_up`) when q_lora_rank is set. Each q/k head
is [no-rotation dims | rotary dims] (head_dim wide), the values v_head_dim wide; the softmax scale is
1 / sqrt(head_dim), times YaRN's correction under a scaled rotation (`yarn.softmax_scale_correction`).

Hugging Face's one `kv_a_proj_with_mqa` ([latent | rotary key] rows) is two Linear layers here (`kv_down`, `k_rope`)
because tensor parallelism holds them differently: every rank needs the whole latent and the whole rotary key, but
the latent enters the heads through the column-parallel `kv_up` (whose input gradient is summed over the ranks),
while the rotary key enters the heads' attention directly, so its layer gathers its input and sums its weight's
gradient itself (`family_specs.SHARED_KEY`). The latent projections and their norms are whole on every rank and run
on the sequence shard under sequence parallelism (`family_specs.LATENT`); `q`, `q_up` and `kv_up` are
column-parallel by heads, `proj` row-parallel.

`rope_interleave` (DeepSeek's checkpoints): the rotary dims pair as (0, 1), (2, 3), ... and come out de-interleaved,
as transformers computes it. Decoding caches the normalised latent and the rotated key (kv_lora_rank +
qk_rope_head_dim numbers per token and block, not heads x (head_dim + v_head_dim)) and brings the heads' keys and
values up from it at each step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.sdpa import sdpa
from mtnlg_lightning.yarn import softmax_scale_correction

# transformers' DeepseekV3RMSNorm of the two latents is built with its default epsilon, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., S, d] rotated pair by pair, (x0, x1), (x2, x3), ..., written de-interleaved: [evens' | odds'] (cos,
    sin [S, d] as `cat(freqs, freqs)`: their first half holds each pair's angle)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated with the first half of its dims paired with the second (every other family's layout)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class MultiHeadLatentAttention(nn.Module):
    """Self-attention through compressed latents (module docstring). `core`: the attention core (`model.py`'s
    `AttentionCore`, swappable as every attention's: selective recomputation, context parallelism's ring)."""

    def __init__(self, config: ModelConfig, core: nn.Module):
        super().__init__()
        heads, h = config.num_heads, config.hidden_size
        self.rope_dim, self.v_head_dim = config.qk_rope_head_dim, config.v_head_dim
        self.nope_dim = config.head_dim - config.qk_rope_head_dim
        self.head_dim = config.head_dim
        if config.q_lora_rank is None:
            self.q = nn.Linear(h, heads * config.head_dim, bias=False)
        else:
            self.q_down = nn.Linear(h, config.q_lora_rank, bias=config.qkv_bias)
            self.q_down_norm = nn.RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_up = nn.Linear(config.q_lora_rank, heads * config.head_dim, bias=False)
        self.kv_down = nn.Linear(h, config.kv_lora_rank, bias=config.qkv_bias)
        self.k_rope = nn.Linear(h, config.qk_rope_head_dim, bias=config.qkv_bias)
        self.kv_down_norm = nn.RMSNorm(config.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_up = nn.Linear(config.kv_lora_rank, heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.proj = nn.Linear(heads * self.v_head_dim, h, bias=config.bias)
        self.rotate = rotate_interleaved if config.rope_interleave else rotate_halves
        # SDPA divides by sqrt(q's width), head_dim: YaRN's correction multiplies the queries instead
        self.query_scale = softmax_scale_correction(config.rope_scaling)
        self.dropout = config.attention_dropout
        self.core = core
        # The values padded with zeros to the q/k width for the core (its output's extra dims are 0, dropped): one
        # head width for every attention kernel (flash blocks, context parallelism's ring), as Megatron pads them.
        self.value_padding = config.head_dim - config.v_head_dim

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, this rank's heads x head_dim]."""
        if hasattr(self, "q"):
            return self.q(x)
        return self.q_up(self.q_down_norm(self.q_down(x)))

    def forward(self, x: torch.Tensor, rotary=None, cache=None, mask=None) -> torch.Tensor:
        """As `model.Attention.forward`: x [B, S, H] (this rank's sequence slice under sequence parallelism) ->
        [B, S, H]."""
        q = self.queries(x)
        B, S, _ = q.shape  # the whole sequence: a column-parallel layer gathers a sequence-parallel input
        q = q.view(B, S, -1, self.head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent = self.kv_down_norm(self.kv_down(x))  # this rank's sequence slice under sequence parallelism
        k_rope = self.k_rope(x).view(B, 1, S, self.rope_dim)
        cos, sin = rotary(S, q.device, q.dtype)
        q_rope, k_rope = self.rotate(q_rope, cos, sin), self.rotate(k_rope, cos, sin)
        if cache is not None:  # the latent and the rotary key are what is cached
            cached, k_rope = cache.update(latent.unsqueeze(1), k_rope)
            latent = cached.squeeze(1)
        kv = self.kv_up(latent)
        kv = kv.view(B, kv.shape[1], -1, self.nope_dim + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        if cache is None:
            padded = F.pad(v, (0, self.value_padding)) if self.value_padding else v
            y = self.core(q, k, padded, self.dropout if self.training else 0.0, mask)[..., : self.v_head_dim]
        else:  # decoding: the new positions attend to every cached one; a prefill (start 0) is causal
            y = sdpa(q, k, v, is_causal=q.shape[2] > 1)
        return self.proj(y.transpose(1, 2).reshape(B, S, -1))
