"""QK-clip (Kimi K2's MuonClip): each attention head's largest pre-softmax logit of the step is tracked in the
forward, and after the update the query and key weights of a head whose maximum exceeds tau are scaled back so that
the same inputs would give exactly tau.

Per head h with maximum S_h > tau: eta = tau / S_h, its query rows (weight and bias) times eta ** alpha and its key
rows times eta ** (1 - alpha) (alpha = 0.5, Kimi's); the logits are bilinear in the two, so they scale by eta. Under
grouped-query attention the maximum is taken over each key/value head's group of query heads (Megatron's rule):
the whole group's query rows and the shared key rows are scaled. Models with q/k norms are refused (the norm undoes
the scaling), as are key/value heads copied over TP ranks (each copy would see another group maximum).

In every layout the maximum is over the step's micro-batches (a running maximum, also over an activation
checkpoint's recomputation), under context parallelism over the whole sequence's keys (gathered over the CP group
for it: the ring attention never holds them all), and then over the world (one MAX all-reduce of [layers, heads],
each rank's entries at its global heads and layers: TP ranks hold different heads, pipeline stages different
layers, data-parallel replicas different samples). The logits are computed beside the attention kernel (which
does not return them): a [B, heads, S, S] product per layer and micro-batch, causal over the whole row (with packed
documents, an upper bound).
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from torch import nn

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.mla import MultiHeadLatentAttention
from mtnlg_lightning.model import Attention, FusedQKVAttention
from mtnlg_lightning.parallel.context_parallel import chunk_indices

ALPHA = 0.5  # the query's share of the scaling (Kimi K2's)


def max_logits(q: torch.Tensor, k: torch.Tensor, query_positions=None, key_positions=None) -> torch.Tensor:
    """Each query head's largest causal pre-softmax logit q.k / sqrt(d): q [B, H, Sq, d], k [B, KV, Sk, d] -> [H];
    the positions in the sequence of the query and key rows (default: both 0 .. S-1) say which key a query sees."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1) if groups > 1 else k
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if query_positions is None:
        query_positions = key_positions = torch.arange(q.shape[2], device=q.device)
    causal = key_positions[None, :] <= query_positions[:, None]
    return scores.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))


def _chunk_positions(cp_rank: int, cp_size: int, chunk: int, device) -> torch.Tensor:
    """The sequence positions of a CP rank's rows: its two chunks (`context_parallel.chunk_indices`)."""
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in chunk_indices(cp_rank, cp_size)])


def context_max_logits(q: torch.Tensor, k: torch.Tensor, ring) -> torch.Tensor:
    """`max_logits` of this CP rank's query chunks against the whole sequence's keys, gathered over the CP group
    (the ring attention never holds them all at once)."""
    parts = [torch.empty_like(k) for _ in range(ring.size)]
    dist.all_gather(parts, k.contiguous(), group=ring.group)
    chunk = k.shape[2] // 2
    keys = [_chunk_positions(r, ring.size, chunk, k.device) for r in range(ring.size)]
    query = _chunk_positions(ring.cp_rank, ring.size, chunk, k.device)
    return max_logits(q, torch.cat(parts, dim=2), query, torch.cat(keys))


class QKClip:
    """The per-head maxima of one model part (`attach`) and the clip (`clip`) of its weights. `num_layers`,
    `num_heads`: the whole model's, the shape of the tensor the ranks reduce."""

    def __init__(self, tau: float, num_layers: int, num_heads: int, num_kv_heads: int):
        if not tau > 0:
            raise MTNLGError(f"model.qk_clip must be > 0, got {tau}")
        self.tau, self.num_layers, self.num_heads, self.num_kv_heads = tau, num_layers, num_heads, num_kv_heads
        self.layers: dict[int, Attention] = {}  # block index -> its attention on this rank
        self.local: dict[int, torch.Tensor] = {}  # block index -> this step's maxima of its local heads
        self.step_max: torch.Tensor | None = None  # [layers, heads] after `reduce`, before the clip
        self.ignore = lambda: False  # e.g. a pipeline's forward of placeholder activations (shape inference)

    def attach(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            if isinstance(module, MultiHeadLatentAttention):  # not an `Attention`: it would go unclipped
                raise MTNLGError(
                    "model.qk_clip does not clip multi-head latent attention yet (Kimi K2 scales each head's "
                    "no-rotation q/k rows and only q's rotary rows)"
                )
            if isinstance(module, Attention):
                if module.qk_norm_over is not None:
                    raise MTNLGError("model.qk_clip cannot clip a model with q/k norms (the norm undoes the scaling)")
                index = int(re.search(r"(?:^|\.)blocks\.(\d+)\.", name + ".").group(1))
                self.layers[index] = module
                module.core.register_forward_pre_hook(self._hook(index))

    def _hook(self, index: int):
        def record(core, args) -> None:
            if self.ignore():
                return
            q, k = args[0].detach(), args[1].detach()
            ring = getattr(core, "ring", None)  # context parallelism's ring attention
            with torch.no_grad():
                found = max_logits(q, k) if ring is None or ring.size == 1 else context_max_logits(q, k, ring)
            seen = self.local.get(index)
            self.local[index] = found if seen is None else torch.maximum(seen, found)

        return record

    def reset(self) -> None:
        self.local.clear()

    def reduce(self, device) -> torch.Tensor:
        """[layers, heads]: every rank's maxima at their global places, reduced (MAX) over the world."""
        table = torch.full((self.num_layers, self.num_heads), float("-inf"), device=device)
        for index, found in self.local.items():
            first = self._first_head(self.layers[index])
            table[index, first : first + found.numel()] = found.to(device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        self.step_max = table
        return table

    @staticmethod
    def _first_head(attention: Attention) -> int:
        """The global index of this rank's first query head (tensor parallelism holds a run of them)."""
        weight = attention.qkv.weight if isinstance(attention, FusedQKVAttention) else attention.q.weight
        local = weight.shape[0] // attention.head_dim // (3 if isinstance(attention, FusedQKVAttention) else 1)
        return getattr(weight, "partition_index", 0) * local

    @torch.no_grad()
    def clip(self) -> int:
        """Scale back the heads over tau (after `reduce`); returns how many (query heads) were clipped here."""
        clipped = 0
        for index, attention in self.layers.items():
            first = self._first_head(attention)
            if isinstance(attention, FusedQKVAttention):
                clipped += self._clip_fused(attention, self.step_max[index], first)
            else:
                clipped += self._clip_grouped(attention, self.step_max[index], first)
        return clipped

    def _eta(self, maxima: torch.Tensor) -> torch.Tensor:
        return torch.where(maxima > self.tau, self.tau / maxima, torch.ones_like(maxima))

    def _clip_fused(self, attention: FusedQKVAttention, maxima: torch.Tensor, first: int) -> int:
        """Rows [heads, 3, head_dim]: head h's q rows (0) and k rows (1)."""
        hd = attention.head_dim
        weight, bias = attention.qkv.weight, attention.qkv.bias
        heads = weight.shape[0] // (3 * hd)
        eta = self._eta(maxima[first : first + heads]).to(weight.dtype)
        scale = torch.stack([eta**ALPHA, eta ** (1 - ALPHA), torch.ones_like(eta)], dim=1)  # [heads, 3]
        weight.view(heads, 3, hd, -1).mul_(scale[:, :, None, None])
        if bias is not None:
            bias.view(heads, 3, hd).mul_(scale[:, :, None])
        return int((eta < 1).sum())

    def _clip_grouped(self, attention: Attention, maxima: torch.Tensor, first: int) -> int:
        hd = attention.head_dim
        heads = attention.q.weight.shape[0] // hd
        kv_heads = attention.k.weight.shape[0] // hd
        group = self.num_heads // self.num_kv_heads
        if heads // kv_heads != group:
            raise MTNLGError("model.qk_clip cannot clip key/value heads copied over tensor-parallel ranks")
        eta = self._eta(maxima[first : first + heads].view(kv_heads, group).amax(dim=1))  # per key/value head
        for linear, factor, repeat in ((attention.q, eta**ALPHA, group), (attention.k, eta ** (1 - ALPHA), 1)):
            rows = factor.repeat_interleave(repeat).repeat_interleave(hd).to(linear.weight.dtype)
            linear.weight.mul_(rows[:, None])
            if linear.bias is not None:
                linear.bias.mul_(rows)
        return int((eta < 1).sum()) * group
