"""A model for inference in one process: the device and dtype asked for, the GPT read from a project checkpoint or a
Hugging Face GPT-2 directory, its weights in the layout decoding is fastest with, and its tokenizer.

Used by `mtnlg-generate`, `mtnlg-eval` and the benchmarks; a model cut over ranks loads through
`inference.engine.ShardedModel.load` instead.
"""

from __future__ import annotations

import torch
from torch import nn

from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.interop.gpt2_mapping import load_model_space
from mtnlg_lightning.interop.hf import read_source
from mtnlg_lightning.model import GPT, build_model


def pick_device(device: str = "auto") -> torch.device:
    """`auto` (the GPU when there is one), or the device asked for if this machine has it (else one line)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise MTNLGError(f"unknown --device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if chosen.type == "cpu":
        return chosen
    backend = getattr(torch, chosen.type, None)
    if backend is None or not getattr(backend, "is_available", lambda: False)():
        raise MTNLGError(f"--device {device}: no {chosen.type} device is available on this machine (use cpu or auto)")
    count = getattr(backend, "device_count", lambda: 1)()
    if chosen.index is not None and chosen.index >= count:
        raise MTNLGError(f"--device {device}: this machine has {count} {chosen.type} device(s)")
    return chosen


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """bf16 where the GPU supports it, else fp32 (`auto`); or what the user asks."""
    if dtype == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def load_model(
    source, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, for_generation: bool = False
):
    """(GPT in eval mode, ModelState) from a project checkpoint or a Hugging Face GPT-2 directory.
    `for_generation`: also store the weights in the layout decoding is fastest with (`use_generation_layout`)."""
    state = read_source(source)
    model = build_model(state.config)
    load_model_space(model, state.weights)
    model = model.to(device=device, dtype=dtype).eval()
    return (use_generation_layout(model) if for_generation else model), state


def _matrices(model: GPT) -> list[nn.Parameter]:
    """The Linear weights of the blocks and the tied embedding / LM head matrix, each once."""
    found = {id(model.embed.wte.weight): model.embed.wte.weight}
    for block in model.blocks.values():
        for linear in (block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2):
            found[id(linear.weight)] = linear.weight
    return list(found.values())


@torch.no_grad()
def use_generation_layout(model: GPT) -> GPT:
    """On a CPU, store every weight matrix [out, in] transposed in memory (strides (1, out)), in place: the same
    parameters, shapes and values, and `model(x)` computes the same function. Decoding multiplies one row per
    sample by each matrix, and there `x @ W` with W's rows laid out [in, out] is the faster matrix-vector product
    (measured on this project's CPU: ~10% on the blocks' Linear layers, ~25% on the LM head, which is also why
    GPT-2's Conv1D layout beats nn.Linear's there). On other devices the model is left as it is."""
    if model.embed.wte.weight.device.type != "cpu":
        return model
    for weight in _matrices(model):
        if weight.is_contiguous():
            weight.data = weight.data.t().contiguous().t()
    return model


def resolve_tokenizer(named, override: str | None = None):
    """The tokenizer `override` names, else the one the checkpoint names (`named`), else one actionable line."""
    path = override or named
    if path is None:
        raise MTNLGError("the checkpoint names no tokenizer: pass --tokenizer PATH (tokenizer.json or directory)")
    return Tokenizer(path)
