"""Model-space weights <-> Hugging Face `GPT2LMHeadModel` tensors, both ways, exactly (no arithmetic on values).

The project's GPT is GPT-2's architecture; only names and layouts differ:
- GPT-2 stores Linear weights as `Conv1D` `[in, out]`: every Linear weight is transposed;
- our qkv output rows are laid out `[heads, 3, head_dim]` (a tensor-parallel column shard then holds whole
  heads), GPT-2's `c_attn` columns `[3, heads, head_dim]`;
- the LM head is tied to the word embedding on both sides, so neither file stores it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError

# per block: our module -> GPT-2's, and whether its weight is a Linear (transposed into Conv1D)
BLOCK_MODULES = {
    "ln1": ("ln_1", False),
    "attn.qkv": ("attn.c_attn", True),
    "attn.proj": ("attn.c_proj", True),
    "ln2": ("ln_2", False),
    "mlp.fc1": ("mlp.c_fc", True),
    "mlp.fc2": ("mlp.c_proj", True),
}
TOP_MODULES = {"embed.wte": "wte", "embed.wpe": "wpe", "norm": "ln_f"}


def _qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads, 3, hd, ...] rows -> [3, heads, hd, ...] rows (weight or bias)."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def _qkv_from_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def name_pairs(num_layers: int):
    """(our module, GPT-2 module under `transformer.`, is_linear) for every module holding parameters."""
    for ours, theirs in TOP_MODULES.items():
        yield ours, theirs, False
    for i in range(num_layers):
        for ours, (theirs, linear) in BLOCK_MODULES.items():
            yield f"blocks.{i}.{ours}", f"h.{i}.{theirs}", linear


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
    """Every weight tensor of a GPT of `num_layers` layers (the tied head excluded), in GPT-2's order."""
    pairs = []
    for ours, theirs, linear in name_pairs(num_layers):
        for kind in ("weight", "bias"):
            if not (ours.startswith("embed") and kind == "bias"):
                pairs.append(
                    TensorPair(
                        f"{ours}.{kind}",
                        f"transformer.{theirs}.{kind}",
                        linear and kind == "weight",
                        ours.endswith("attn.qkv"),
                    )
                )
    return pairs


def to_hf(weights: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Model-space weights -> GPT-2 state dict (`transformer.*`, tied `lm_head` omitted as `save_pretrained` does)."""
    return {p.theirs: p.to_hf(weights[p.ours], config.num_heads) for p in tensor_pairs(config.num_layers)}


# GPT-2 files may carry the causal-mask buffers (`attn.bias`, `attn.masked_bias`): constants, not weights.
CONSTANT_BUFFERS = ("attn.bias", "attn.masked_bias")


def from_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT-2 state dict (with or without the `transformer.` prefix) -> model-space weights."""
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    head = state.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, state.get("wte.weight", head)):
        raise MTNLGError("the source's lm_head is not tied to its word embedding; this GPT ties them")
    out = {}
    for pair in tensor_pairs(config.num_layers):
        key = pair.theirs.removeprefix("transformer.")
        if key not in state:
            raise MTNLGError(f"the source has no tensor {key!r} (not a GPT-2 model of {config.num_layers} layers?)")
        out[pair.ours] = pair.from_hf(state.pop(key), config.num_heads)
    leftover = sorted(k for k in state if not k.endswith(CONSTANT_BUFFERS))
    if leftover:
        raise MTNLGError(f"the source has tensors this GPT does not use: {', '.join(leftover[:5])}")
    return out


@torch.no_grad()
def load_model_space(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy model-space weights into a full single-process `GPT` (before any strategy shards it). The word
    embedding rows past the source's vocabulary (padding for the layout) are zeroed: no token maps to them.
    `weights` may be lazy (`LazyWeights`): each tensor is read when its parameter is filled, then let go."""
    params = {k: p for k, p in model.named_parameters() if k != "lm_head.weight"}
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise MTNLGError(f"weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, param in params.items():
        source = weights[name]
        if name == "embed.wte.weight" and source.shape[0] <= param.shape[0] and source.shape[1:] == param.shape[1:]:
            param[source.shape[0] :].zero_()
            param[: source.shape[0]].copy_(source)
        elif source.shape != param.shape:
            raise MTNLGError(f"{name}: the source has shape {tuple(source.shape)}, the model {tuple(param.shape)}")
        else:
            param.copy_(source)
