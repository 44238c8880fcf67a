"""Model hyper-parameters and named presets (tiny ... mtnlg-530b)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mtnlg_lightning.errors import MTNLGError


@dataclass
class ModelConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int = 50257
    ffn_hidden_size: int | None = None  # None -> 4 * hidden_size
    # Megatron pads the vocabulary so the embedding splits evenly and GEMMs stay aligned.
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int | None = None  # None -> seq_len
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_eps: float = 1e-5
    init_std: float | None = None  # None -> sqrt(1 / (3 * hidden_size)), as MT-NLG
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_len
        if self.init_std is None:
            self.init_std = math.sqrt(1.0 / (3.0 * self.hidden_size))
        if self.hidden_size % self.num_heads:
            raise MTNLGError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.seq_len > self.max_position_embeddings:
            raise MTNLGError(
                f"seq_len {self.seq_len} is above the position table size {self.max_position_embeddings} "
                f"(max_position_embeddings); lower seq_len or raise max_position_embeddings"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return int(math.ceil(self.vocab_size / multiple) * multiple)


PRESETS: dict[str, dict] = {
    # Table/Section 3 of the MT-NLG paper.
    "mtnlg-530b": dict(num_layers=105, hidden_size=20480, num_heads=128, seq_len=2048),
    # GPT-3 paper, Table 2.1 (heads of the 1.3B model as Megatron runs it: 16 x 128).
    "gpt3-175b": dict(num_layers=96, hidden_size=12288, num_heads=96, seq_len=2048),
    "gpt3-1.3b": dict(num_layers=24, hidden_size=2048, num_heads=16, seq_len=2048),
    "gpt3-125m": dict(num_layers=12, hidden_size=768, num_heads=12, seq_len=2048),
    # The offline demo: big enough to visibly learn the built-in corpus on 2 CPU cores in minutes.
    "demo": dict(num_layers=4, hidden_size=256, num_heads=4, seq_len=128, vocab_size=4096),
    # Seconds-scale model for tests and every parallel-equivalence check.
    "tiny": dict(num_layers=2, hidden_size=64, num_heads=4, seq_len=64, vocab_size=4096),
}


def deep_merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`, recursing into nested dicts (as YAML configs and DeepSpeed overrides combine)."""
    out = dict(base)
    for key, value in extra.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = deep_merge(out[key], value) if both else value
    return out


def get_config(preset: str, **overrides) -> ModelConfig:
    """Build a config from a preset name, with field overrides (e.g. num_layers=5)."""
    if preset not in PRESETS:
        raise MTNLGError(f"unknown model preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise MTNLGError(f"unknown model config field(s) {unknown}; valid fields: {sorted(known)}")
    # The position table belongs to the preset (as it would to a checkpoint): a longer seq_len is an error.
    values = {"max_position_embeddings": PRESETS[preset]["seq_len"], **PRESETS[preset], **overrides}
    return ModelConfig(**values, name=preset)


def count_parameters(config: ModelConfig, tensor_parallel: int = 1) -> int:
    """Exact parameter count of `GPT(config)` (tied head counted once), computed arithmetically."""
    h, f, L = config.hidden_size, config.ffn_hidden_size, config.num_layers
    vocab = config.padded_vocab_size(tensor_parallel)
    embeddings = vocab * h + config.max_position_embeddings * h
    attention = h * 3 * h + 3 * h + h * h + h
    mlp = h * f + f + f * h + h
    layernorms = 2 * 2 * h
    final_norm = 2 * h
    return embeddings + L * (attention + mlp + layernorms) + final_norm
