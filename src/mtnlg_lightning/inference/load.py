"""The one loader of a model for inference: any source (a project checkpoint folder or `.ckpt` file, a Hugging Face
directory), any layout (one process is 1 x 1 x 1), each rank reading only its own slices; the device and dtype asked
for; the weights in the layout decoding is fastest with; the tokenizer.

Used by `mtnlg-eval`, `mtnlg-generate` (through `inference.runs`), the harness adapter and the benchmarks.
"""

from __future__ import annotations

import torch

from mtnlg_lightning.checkpoint.model_state import ModelState
from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.inference.sharded_model import ShardedModel
from mtnlg_lightning.interop.hf import read_source
from mtnlg_lightning.parallel.layout import ProcessGroups
from mtnlg_lightning.parallel.parallelize import PipelineParallelSettings


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


def load(
    state: ModelState,
    groups: ProcessGroups,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    pipeline: PipelineParallelSettings | None = None,
    sequence_parallel: bool = False,
    for_generation: bool = False,
    context_parallel_kernel: str = "auto",
) -> ShardedModel:
    """This rank's part of the model `state` holds, in the layout of `groups`, in eval mode. `for_generation`: also
    store the weights in the layout decoding is fastest with (`use_generation_layout`)."""
    model = ShardedModel.load(
        state.weights,
        state.config,
        groups,
        device,
        dtype,
        pipeline or PipelineParallelSettings(),
        sequence_parallel,
        context_parallel_kernel,
    )
    if for_generation:
        for module in model.modules():
            use_generation_layout(module)
    return model


def load_model(
    source, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, for_generation: bool = False
):
    """(the whole model in eval mode, its `ModelState`) in this process, from any source (the 1 x 1 x 1 `load`)."""
    state = read_source(source, verify="all")
    model = load(state, ProcessGroups.single(), torch.device(device), dtype, for_generation=for_generation)
    return model.modules()[0], state


@torch.no_grad()
def use_generation_layout(model: torch.nn.Module) -> torch.nn.Module:
    """On a CPU, store every weight matrix [out, in] transposed in memory (strides (1, out)), in place: the same
    parameters, shapes and values, and `model(x)` computes the same function. Decoding multiplies one row per
    sample by each matrix, and there `x @ W` with W's rows laid out [in, out] is the faster matrix-vector product
    (measured on this project's CPU: ~10% on the blocks' Linear layers, ~25% on the LM head, which is also why
    GPT-2's Conv1D layout beats nn.Linear's there). On other devices the model is left as it is."""
    matrices = {id(p): p for p in model.parameters() if p.dim() == 2}
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    if head is not None:  # a last stage's copy of the tied embedding is a plain tensor, not a parameter
        matrices.setdefault(id(head), head)
    for weight in matrices.values():
        if weight.device.type == "cpu" and weight.is_contiguous():
            weight.data = weight.data.t().contiguous().t()
    return model


def resolve_tokenizer(named, override: str | None = None):
    """The tokenizer `override` names, else the one the source names (`named`), else one actionable line."""
    path = override or named
    if path is None:
        raise MTNLGError("the checkpoint names no tokenizer: pass --tokenizer PATH (tokenizer.json or directory)")
    return Tokenizer(path)
