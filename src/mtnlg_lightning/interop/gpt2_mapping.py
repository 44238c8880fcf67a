"""Model-space weights <-> Hugging Face `GPT2LMHeadModel` tensors, both ways, exactly (no arithmetic on values), and
GPT-2's `config.json` <-> `ModelConfig`.

The project's GPT is GPT-2's architecture; only names and layouts differ:
- GPT-2 stores Linear weights as `Conv1D` `[in, out]`: every Linear weight is transposed;
- our qkv output rows are laid out `[heads, 3, head_dim]` (a tensor-parallel column shard then holds whole
  heads), GPT-2's `c_attn` columns `[3, heads, head_dim]`;
- the LM head is tied to the word embedding on both sides, so neither file stores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mtnlg_lightning.checkpoint.safetensors_shards import TensorSpec
from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import hf_tensors
from mtnlg_lightning.family_specs import GPT, MATMUL_STYLES

MODEL_TYPES = (GPT.hf_model_type,)
HEAD = "lm_head.weight"
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # both are GeLU with the tanh approximation, as our MLP


def _qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads, 3, hd, ...] rows -> [3, heads, hd, ...] rows (weight or bias)."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def _qkv_from_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)


@dataclass(frozen=True)
class TensorPair:
    """One tensor on both sides: our model-space name, GPT-2's (under `transformer.`), and how to convert."""

    ours: str
    theirs: str
    linear_weight: bool  # stored transposed by GPT-2's Conv1D
    qkv: bool  # rows (ours) / columns (theirs) in a different head order

    def to_hf(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        if self.qkv:
            t = _qkv_to_hf(t, heads)
        return (t.t() if self.linear_weight else t).contiguous()

    def from_hf(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        if self.linear_weight:
            t = t.t()
        return (_qkv_from_hf(t, heads) if self.qkv else t).contiguous()

    def hf_shape(self, ours_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(reversed(ours_shape)) if self.linear_weight else tuple(ours_shape)


def tensor_pairs(num_layers: int) -> list[TensorPair]:
    """Every weight tensor of a GPT of `num_layers` layers (the tied head excluded), in GPT-2's order: the GPT
    family's modules under their GPT-2 names (`families.GPT`), their Linear layers stored transposed."""
    plan = GPT.tensor_parallel_plan()
    pairs = []
    for ours, (theirs,) in hf_tensors(GPT, _gpt2_block(num_layers)).items():
        module, _, kind = ours.rpartition(".")
        style = plan[module.split(".", 2)[2] if module.startswith("blocks.") else module]
        pairs.append(TensorPair(ours, theirs, style in MATMUL_STYLES and kind == "weight", module.endswith("attn.qkv")))
    return pairs


def _gpt2_block(num_layers: int) -> ModelConfig:
    """A GPT-2 block of `num_layers` layers: its tensors' names do not depend on its sizes."""
    return ModelConfig(num_layers=num_layers, hidden_size=8, num_heads=1, seq_len=1, vocab_size=1, family=GPT.name)


# GPT-2 files may carry the causal-mask buffers (`attn.bias`, `attn.masked_bias`): constants, not weights.
CONSTANT_BUFFERS = ("attn.bias", "attn.masked_bias")


# GPT-2 config keys written from the model config on export (the vocabulary is the tokenizer's; import reads the
# same keys back in `read_config`, with GPT-2's defaults for the optional ones).
EXPORTED_FIELDS = {
    "n_positions": "max_position_embeddings",
    "n_embd": "hidden_size",
    "n_layer": "num_layers",
    "n_head": "num_heads",
    "n_inner": "ffn_hidden_size",
    "resid_pdrop": "hidden_dropout",
    "embd_pdrop": "hidden_dropout",
    "attn_pdrop": "attention_dropout",
    "layer_norm_epsilon": "layernorm_eps",
    "initializer_range": "init_std",
}
HF_REQUIRED = ("n_layer", "n_embd", "n_head", "vocab_size")
HF_OPTIONAL_INTS = ("n_positions", "n_inner")
HF_RATES = ("resid_pdrop", "attn_pdrop", "embd_pdrop")


def read_config(cfg: dict, path: Path) -> ModelConfig:
    """The architecture of a GPT-2 `config.json`; a variant this decoder does not have is one line."""
    problems = []
    if cfg.get("activation_function", "gelu_new") not in TANH_GELUS:
        problems.append(f"activation_function {cfg['activation_function']!r} (this GPT uses tanh GeLU)")
    if not cfg.get("scale_attn_weights", True) or cfg.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("non-standard attention scaling")
    if not cfg.get("tie_word_embeddings", True):
        problems.append("an untied LM head")
    if problems:
        raise MTNLGError(f"{path}: GPT-2 variant with {', '.join(problems)} cannot be imported")
    _check_keys(path, cfg)
    n_positions = cfg.get("n_positions", 1024)
    return ModelConfig(
        num_layers=cfg["n_layer"],
        hidden_size=cfg["n_embd"],
        num_heads=cfg["n_head"],
        seq_len=n_positions,
        vocab_size=cfg["vocab_size"],
        ffn_hidden_size=cfg.get("n_inner") or 4 * cfg["n_embd"],
        max_position_embeddings=n_positions,
        hidden_dropout=cfg.get("resid_pdrop", 0.0),
        attention_dropout=cfg.get("attn_pdrop", 0.0),
        layernorm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        name=cfg.get("_name_or_path") or path.name,
        family=GPT.name,
    )


def _check_keys(path: Path, cfg: dict) -> None:
    """The keys the import reads, by type and range: a missing or wrong one is one line naming it."""
    where = path / "config.json"
    for key in HF_REQUIRED + HF_OPTIONAL_INTS:
        value = cfg.get(key)
        if key in HF_REQUIRED and key not in cfg:
            raise MTNLGError(f"{where} has no {key!r} (a GPT-2 config needs {', '.join(HF_REQUIRED)})")
        if (key in HF_REQUIRED or value is not None) and not (
            isinstance(value, int) and not isinstance(value, bool) and value >= 1
        ):
            raise MTNLGError(f"{where}: {key} is {value!r}, expected an integer >= 1")
    for key in (*HF_RATES, "layer_norm_epsilon"):
        value = cfg.get(key, 0.0)
        if not (isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1):
            raise MTNLGError(f"{where}: {key} is {value!r}, expected a number in [0, 1)")


def hf_config(transformers, config: ModelConfig, vocab: int, eod_id: int | None, dtype: str):
    if config.head_dim * config.num_heads != config.hidden_size:  # GPT-2's config.json cannot name another
        raise MTNLGError(f"a GPT-2's head_dim is hidden_size / num_heads, not {config.head_dim}")
    return transformers.GPT2Config(
        vocab_size=vocab,
        **{key: getattr(config, field) for key, field in EXPORTED_FIELDS.items()},
        activation_function="gelu_new",
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        tie_word_embeddings=True,
        architectures=["GPT2LMHeadModel"],
        dtype=dtype,
    )


def _pairs(config: ModelConfig) -> dict[str, TensorPair]:
    return {pair.ours: pair for pair in tensor_pairs(config.num_layers)}


def sources(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each model-space tensor and the (one) GPT-2 tensor it is, in GPT-2's order."""
    return hf_tensors(GPT, config)


def from_hf(name: str, tensors: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    return _pairs(config)[name].from_hf(tensors[0], config.num_heads)


def ours_shape(name: str, shapes: list[tuple[int, ...]], config: ModelConfig) -> tuple[int, ...]:
    return _pairs(config)[name].hf_shape(shapes[0])  # a transpose is its own inverse


def normalize(name: str) -> str:
    """A stored tensor's name as `sources` spells it (`transformer.` is optional in GPT-2 files)."""
    return name if name.startswith("transformer.") or name == HEAD else f"transformer.{name}"


def is_constant(name: str, config: ModelConfig | None = None) -> bool:
    """The causal-mask buffers some GPT-2 files carry: constants, not weights."""
    return name.endswith(CONSTANT_BUFFERS)


def tensor_specs(weights, config: ModelConfig, vocab: int, dtype: torch.dtype) -> list[TensorSpec]:
    """GPT-2's tensors, each produced rows at a time from boxes of our model-space tensors: GPT-2's rows of a
    Linear weight are our columns, of anything else our rows (the qkv bias, reordered whole, is small)."""

    def rows_of(pair: TensorPair, shape: tuple[int, ...]):
        def rows(r0: int, r1: int) -> torch.Tensor:
            if pair.linear_weight:
                return pair.to_hf(weights.read_box(pair.ours, (0, r0), (shape[0], r1 - r0)), config.num_heads)
            if pair.qkv:
                return pair.to_hf(weights.read_box(pair.ours, (0,), shape), config.num_heads)[r0:r1]
            return weights.read_box(pair.ours, (r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:]))

        return rows

    specs = []
    for pair in tensor_pairs(config.num_layers):
        shape = weights.shape(pair.ours)
        if pair.ours == "embed.wte.weight":  # the padded rows and any past the tokenizer's ids: never produced
            shape = (vocab, *shape[1:])
        specs.append(TensorSpec(pair.theirs, pair.hf_shape(shape), dtype, rows_of(pair, shape)))
    return specs
