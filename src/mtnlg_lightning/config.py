"""Model hyper-parameters and named presets (tiny ... mtnlg-530b)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mtnlg_lightning.errors import MTNLGError

POSITION_EMBEDDINGS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
ROPE_SCALINGS = ("default", "linear", "llama3")  # Hugging Face's `rope_type` names


@dataclass
class ModelConfig:
    """One decoder, its block chosen by options: MT-NLG / GPT-3 (learned positions, LayerNorm, GELU MLP, full
    multi-head attention, biases, tied head: the defaults) or Llama 3 / Qwen 3 (RoPE, RMSNorm, SwiGLU, grouped-query
    attention, no biases, untied head, q/k norms)."""

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
    layernorm_eps: float = 1e-5  # the epsilon of every norm, LayerNorm or RMSNorm
    init_std: float | None = None  # None -> sqrt(1 / (3 * hidden_size)), as MT-NLG
    name: str = "custom"
    position_embedding: str = "learned"  # learned (a position table) | rope (rotary, on q and k)
    rope_theta: float = 10000.0
    # Hugging Face's form: {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # "original_max_position_embeddings": 8192}, or {"rope_type": "linear", "factor": F}; None: unscaled.
    rope_scaling: dict | None = None
    norm: str = "layernorm"  # layernorm | rmsnorm
    mlp: str = "gelu"  # gelu (fc1, fc2) | swiglu (down(silu(gate(x)) * up(x)))
    num_kv_heads: int | None = None  # None -> num_heads (MHA); fewer is grouped-query attention, 1 is MQA
    head_dim: int | None = None  # None -> hidden_size / num_heads
    qk_norm: bool = False  # an RMSNorm over each head's q and k before RoPE (Qwen 3)
    bias: bool = True  # biases of the linear layers and LayerNorms
    qkv_bias: bool | None = None  # biases of q, k, v only (Qwen 2); None -> as `bias`
    tie_embeddings: bool = True  # the LM head is the word embedding

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_len
        if self.init_std is None:
            self.init_std = math.sqrt(1.0 / (3.0 * self.hidden_size))
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        for name, value, choices in (
            ("position_embedding", self.position_embedding, POSITION_EMBEDDINGS),
            ("norm", self.norm, NORMS),
            ("mlp", self.mlp, MLPS),
        ):
            if value not in choices:
                raise MTNLGError(f"model {name} {value!r} is not one of {', '.join(choices)}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise MTNLGError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise MTNLGError(
                f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads} (each key/value "
                f"head serves a whole group of query heads)"
            )
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise MTNLGError(f"rope needs an even head_dim, got {self.head_dim}")
        check_rope_scaling(self.rope_scaling)
        if self.seq_len > self.max_position_embeddings:
            raise MTNLGError(
                f"seq_len {self.seq_len} is above the position table size {self.max_position_embeddings} "
                f"(max_position_embeddings); lower seq_len or raise max_position_embeddings"
            )

    @property
    def fused_qkv(self) -> bool:
        """One q/k/v projection, rows laid out [heads, 3, head_dim] (multi-head attention); grouped-query
        attention has three (its key/value heads may be replicated over the tensor-parallel ranks)."""
        return self.num_kv_heads == self.num_heads

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return int(math.ceil(self.vocab_size / multiple) * multiple)


def check_rope_scaling(scaling: dict | None) -> None:
    """A rope_scaling of a known type with the fields it needs (one line otherwise)."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise MTNLGError(f"rope_scaling must be a mapping with rope_type, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_SCALINGS:
        raise MTNLGError(f"rope_scaling of unknown type {kind!r}; known types: {', '.join(ROPE_SCALINGS)}")
    needed = {"linear": ("factor",), "llama3": LLAMA3_SCALING_FIELDS}.get(kind, ())
    missing = [k for k in needed if not isinstance(scaling.get(k), int | float) or isinstance(scaling.get(k), bool)]
    if missing:
        raise MTNLGError(f"rope_scaling of type {kind} needs the number(s) {', '.join(missing)}")


LLAMA3_SCALING_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
LLAMA_31 = dict(
    position_embedding="rope",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
    tie_embeddings=False,
    vocab_size=128256,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
    init_std=0.02,
)


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
    # Today's dense families, with the published shapes (parameter counts equal the Hugging Face models').
    "llama3.2-1b": {
        **LLAMA_31,
        **dict(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, ffn_hidden_size=8192),
        "tie_embeddings": True,
        "seq_len": 8192,
        "rope_scaling": {**LLAMA_31["rope_scaling"], "factor": 32.0},
    },
    "llama3.1-8b": {
        **LLAMA_31,
        **dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336, seq_len=8192),
    },
    "llama3.1-70b": {
        **LLAMA_31,
        **dict(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672, seq_len=8192),
    },
    "llama3.1-405b": {
        **LLAMA_31,
        **dict(num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8, ffn_hidden_size=53248, seq_len=8192),
    },
    "qwen3-8b": dict(
        num_layers=36,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        ffn_hidden_size=12288,
        vocab_size=151936,
        seq_len=4096,
        max_position_embeddings=40960,
        position_embedding="rope",
        rope_theta=1000000.0,
        norm="rmsnorm",
        layernorm_eps=1e-6,
        mlp="swiglu",
        qk_norm=True,
        bias=False,
        tie_embeddings=False,
        init_std=0.02,
    ),
    # The offline Llama-style demo (configs/demo_llama.yaml): the demo's size in the Llama 3 block.
    "demo-llama": {
        **LLAMA_31,
        **dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, ffn_hidden_size=688, seq_len=128),
        "vocab_size": 4096,
        "max_position_embeddings": 1024,
        "rope_scaling": {**LLAMA_31["rope_scaling"], "original_max_position_embeddings": 256},
    },
    # Seconds-scale Llama 3 block (GQA 4:2, Llama 3 RoPE scaling, untied head) for tests.
    "tiny-llama": {
        **LLAMA_31,
        **dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=160, seq_len=64),
        "vocab_size": 4096,
        "max_position_embeddings": 1024,
        "rope_scaling": {**LLAMA_31["rope_scaling"], "original_max_position_embeddings": 128},
    },
}


def deep_merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`, recursing into nested dicts (as YAML configs and DeepSpeed overrides combine)."""
    out = dict(base)
    for key, value in extra.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = deep_merge(out[key], value) if both else value
    return out


def fields_from(cls, source, **given):
    """A `cls` (a dataclass of settings) filled from `source`: each field from the attribute of the same name (the
    parsed flags of a command, a job's config), unless `given` names its value."""
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**{n: given[n] if n in given else getattr(source, n) for n in names if n in given or hasattr(source, n)})


def reject_unknown_fields(values: dict, cls, what: str) -> None:
    """One line naming the keys of `values` that are no field of the dataclass `cls`, and the valid ones."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise MTNLGError(f"{what} {unknown}; valid fields: {sorted(known)}")


def get_config(preset: str, **overrides) -> ModelConfig:
    """Build a config from a preset name, with field overrides (e.g. num_layers=5)."""
    if preset not in PRESETS:
        raise MTNLGError(f"unknown model preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    reject_unknown_fields(overrides, ModelConfig, "unknown model config field(s)")
    # The position table belongs to the preset (as it would to a checkpoint): a longer seq_len is an error.
    values = {"max_position_embeddings": PRESETS[preset]["seq_len"], **PRESETS[preset], **overrides}
    return ModelConfig(**values, name=preset)
