"""Model-space weights <-> Hugging Face `GPT2LMHeadModel` tensors, both ways, exactly (no arithmetic on values).

The project's GPT is GPT-2's architecture; only names and layouts differ:
- GPT-2 stores Linear weights as `Conv1D` `[in, out]`: every Linear weight is transposed;
- our qkv output rows are laid out `[heads, 3, head_dim]` (a tensor-parallel column shard then holds whole
  heads), GPT-2's `c_attn` columns `[3, heads, head_dim]`;
- the LM head is tied to the word embedding on both sides, so neither file stores it.
"""

from __future__ import annotations

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


def to_hf(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Model-space weights -> GPT-2 state dict (`transformer.*`, tied `lm_head` omitted as `save_pretrained` does)."""
    out = {}
    for ours, theirs, linear in name_pairs(config.num_layers):
        for kind in ("weight", "bias"):
            if ours.startswith("embed") and kind == "bias":
                continue
            t = weights[f"{ours}.{kind}"]
            if ours.endswith("attn.qkv"):
                t = _qkv_to_hf(t, config.num_heads)
            if linear and kind == "weight":
                t = t.t()
            out[f"transformer.{theirs}.{kind}"] = t.contiguous()
    return out


def from_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT-2 state dict (with or without the `transformer.` prefix) -> model-space weights."""
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    head = state.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, state.get("wte.weight", head)):
        raise MTNLGError("the source's lm_head is not tied to its word embedding; this GPT ties them")
    out = {}
    for ours, theirs, linear in name_pairs(config.num_layers):
        for kind in ("weight", "bias"):
            if ours.startswith("embed") and kind == "bias":
                continue
            key = f"{theirs}.{kind}"
            if key not in state:
                raise MTNLGError(f"the source has no tensor {key!r} (not a GPT-2 model of {config.num_layers} layers?)")
            t = state.pop(key)
            if linear and kind == "weight":
                t = t.t()
            if ours.endswith("attn.qkv"):
                t = _qkv_from_hf(t, config.num_heads)
            out[f"{ours}.{kind}"] = t.contiguous()
    # GPT-2 files may carry the causal-mask buffers (`attn.bias`, `attn.masked_bias`): constants, not weights.
    leftover = sorted(k for k in state if not k.endswith(("attn.bias", "attn.masked_bias")))
    if leftover:
        raise MTNLGError(f"the source has tensors this GPT does not use: {', '.join(leftover[:5])}")
    return out


@torch.no_grad()
def load_model_space(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy model-space weights into a full single-process `GPT` (before any strategy shards it). The word
    embedding rows past the source's vocabulary (padding for the layout) are zeroed: no token maps to them."""
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
