"""The MT-NLG / Megatron GPT decoder as a plain nn.Module. Parallelism is applied from outside.

Shapes: B batch, S sequence, H hidden, V padded vocabulary. The module keeps no parallel code paths:
tensor parallelism swaps its Linear/Embedding layers for sharded ones (their `out_features` shrink and the
attention infers its local head count), pipeline parallelism deletes the parts a stage does not own
(`embed`, blocks, `norm`, `lm_head` may be None/absent), as torchtitan does.

Decoding passes a `KVCache` to `GPT.forward` (nanoGPT / litgpt style): the same blocks then write their keys and
values at the cache's position and attend over everything cached, so the single-process model, a tensor-parallel
shard (local heads) and a pipeline stage (its own blocks) all decode with this one forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        # qkv output is laid out [heads, 3, head_dim] so a contiguous column shard holds whole heads.
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = config.attention_dropout
        # Swappable so activation checkpointing can recompute just the attention core (Megatron's selective).
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        qkv = self.qkv(x)
        B, S, _ = qkv.shape  # from the projection: a sequence-parallel qkv receives a slice and gathers it
        qkv = qkv.view(B, S, -1, 3, self.head_dim)  # -1: heads held by this rank
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))  # each [B, heads, S, head_dim]
        if cache is None:
            y = self.core(q, k, v, self.dropout if self.training else 0.0)
        else:  # decoding: one new position attends to every cached one; a prefill (start 0) is causal
            k, v = cache.update(k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=S > 1)
        return self.proj(y.transpose(1, 2).reshape(B, S, -1))


class AttentionCore(nn.Module):
    """softmax(QK^T / sqrt(d)) V with a causal mask; flash/memory-efficient kernels where available."""

    def forward(self, q, k, v, dropout_p: float = 0.0):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x), cache))
        return x + self.dropout(self.mlp(self.ln2(x)))


class Embedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(config.padded_vocab_size(), config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return self.dropout(self.wte(tokens) + self.wpe(positions))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        # A dict keeps parameter names stable when pipeline stages delete the blocks they do not own.
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.num_layers)})
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.padded_vocab_size(), bias=False)
        self.lm_head.weight = self.embed.wte.weight  # tied input/output embedding
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Megatron init: N(0, std) everywhere, output projections scaled by 1/sqrt(2 * num_layers)."""
        std = self.config.init_std
        out_std = std / math.sqrt(2.0 * self.config.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scaled = name.endswith("attn.proj") or name.endswith("mlp.fc2")
                nn.init.normal_(module.weight, mean=0.0, std=out_std if scaled else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """tokens [B, S] int64 (or hidden states [B, S, H] on a pipeline stage without `embed`) -> logits [B, S, V].
        With a `cache`, the tokens sit at positions cache.start.. and their keys and values are cached; decoding
        needs only the last position's logits, so only it goes through the LM head ([B, 1, V], as nanoGPT)."""
        start = cache.start if cache is not None else 0
        h = (self.embed(tokens, start) if start else self.embed(tokens)) if self.embed is not None else tokens
        for name, block in self.blocks.items():
            h = block(h, cache.layer(name)) if cache is not None else block(h)
        if cache is not None and self.lm_head is not None:
            h = h[:, -1:]
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


class KVCache:
    """Keys and values of a model's (or a pipeline stage's) blocks for up to `length` positions, allocated at a
    block's first use with the shape its attention produces (local heads under tensor parallelism). The caller
    sets `start`, the position of the next tokens, before each forward."""

    def __init__(self, length: int):
        self.length, self.start = length, 0
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}

    def layer(self, name: str) -> LayerCache:
        return LayerCache(self, name)


class LayerCache:
    """One block's view of a `KVCache`."""

    def __init__(self, cache: KVCache, name: str):
        self.cache, self.name = cache, name

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, heads, S, hd] at positions start..start+S; return every cached position up to there."""
        c = self.cache
        start, end = c.start, c.start + k.shape[2]
        if k.shape[2] > 1 and start:
            raise ValueError("several new positions at once only from position 0 (the prefill)")
        if end > c.length:
            raise ValueError(f"position {end} is beyond the cache's {c.length}")
        if self.name not in c.keys:
            shape = (k.shape[0], k.shape[1], c.length, k.shape[3])
            c.keys[self.name] = k.new_empty(shape)
            c.values[self.name] = v.new_empty(shape)
        keys, values = c.keys[self.name], c.values[self.name]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]


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
