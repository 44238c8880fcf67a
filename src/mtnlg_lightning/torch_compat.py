"""Every private torch name the package relies on, reached through this one module (torch elastic's agent aside:
`resilience/elastic_compat.py`).

torch has no public way yet to run one GEMM over many experts, to compute attention blocks that return their
log-sum-exp (and their backward given it), to set a process group's timeout after it was made, or to tell which
buffers a module keeps out of its state_dict. These names do it. `tests/test_framework_compat.py` lists them all
(with who needs each), checks them against the installed torch, and scans the package for any private torch name
reached elsewhere: when a release moves one, it fails naming it and this module is the only place to change. The
torch floor in `pyproject.toml` is the first release that has every one of them. Each wrapper calls the very
same op as its callers did before it, with the same arguments: the numbers do not change.

This module imports torch only (its distributed parts on use): it sits below every module of the package.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------- optimizers
# What torch.optim.AdamW's step passes from a group to the functional `adam` (torch 2.13).
ADAM_SETTINGS = ("amsgrad", "lr", "weight_decay", "eps", "maximize", "foreach", "capturable", "differentiable", "fused")


def adamw_group_step(optimizer: torch.optim.AdamW, group: dict) -> None:
    """What `torch.optim.AdamW.step` does for one of `optimizer`'s param groups (its private `_init_group`, then the
    functional `adam`): an optimizer that steps some groups otherwise (`parallel/muon.py`) steps the rest with it."""
    from torch.optim.adam import adam

    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
    has_complex = optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
    if not params:
        return
    beta1, beta2 = group["betas"]
    settings = {key: group[key] for key in ADAM_SETTINGS} | {"decoupled_weight_decay": True}
    moments = (exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    adam(params, grads, *moments, steps, has_complex=has_complex, beta1=beta1, beta2=beta2, **settings)


# ------------------------------------------------------------------------------------------- modules
def non_persistent_buffer_names(module: torch.nn.Module) -> set[str]:
    """The names of `module`'s own buffers registered with `persistent=False`. torch keeps them in a private set
    (its state_dict reads it); were it gone, the names of `module.named_buffers(recurse=False)` missing from
    `module.state_dict(keep_vars=True)` say the same."""
    return module._non_persistent_buffers_set


# ------------------------------------------------------------------------------------------- experts (moe.py)
def has_grouped_mm() -> bool:
    """Whether this torch has its grouped GEMM (`torch._grouped_mm`: CUDA from 2.8, any device from 2.9)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, in] with rows grouped by expert (`offsets`: each group's end row, int32) @ weights [E, in, out] ->
    [N, out], one GEMM for all experts. torch's own MoE building block, private until the public
    `torch.nn.functional.grouped_mm` (torch >= 2.11 has it) replaces it."""
    return torch._grouped_mm(x, weights, offs=offsets)


# ------------------------------------------------------------------------------------------- attention blocks
# Context parallelism's ring (`parallel/context_parallel.py`) merges attention blocks by their log-sum-exp and runs
# their backward against the final output and log-sum-exp: only ATen's private SDPA kernels give and take it (the
# public `scaled_dot_product_attention` returns neither). torch's own ring attention (torch.distributed.tensor's
# context parallelism) calls the same ops; its public API would replace them. Each returns (out, lse [B, H, Lq]) or
# (dq, dk, dv).
def flash_attention_cpu(q, k, v, causal: bool):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def flash_attention_cpu_backward(grad, q, k, v, out, lse, causal: bool):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal)


def flash_attention(q, k, v, causal: bool):
    """CUDA's flash kernel (bf16/fp16)."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    return out, lse


def flash_attention_backward(grad, q, k, v, out, lse, causal: bool):
    sizes = (q.shape[2], k.shape[2])
    empty = torch.empty(0, device=q.device)
    none = torch.zeros((), dtype=torch.long, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, empty, empty, *sizes, 0.0, causal, none, none
    )


def efficient_attention(q, k, v, causal: bool):
    """CUDA's memory-efficient kernel (fp32 too)."""
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
    return out, lse[..., : q.shape[2]]  # the kernel pads its log-sum-exp rows


def efficient_attention_backward(grad, q, k, v, out, lse, causal: bool):
    padded = F.pad(lse, (0, -lse.shape[-1] % 32))  # the padding the forward kernel returned
    none = torch.zeros((), dtype=torch.long, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, out, padded, none, none, 0.0, [True, True, True, False], causal
    )
    return dq, dk, dv


# ------------------------------------------------------------------------------------------- gradients (clip.py)
def flatten_dense_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors in one flat buffer, for one collective (what DDP and DeepSpeed bucket with); were it gone,
    `torch.cat([t.reshape(-1) for t in tensors])` makes the same buffer."""
    return torch._utils._flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat: torch.Tensor, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of `flat` shaped as `tensors` (the inverse of `flatten_dense_tensors`); were it gone,
    `flat.split([t.numel() for t in tensors])` viewed as each tensor."""
    return torch._utils._unflatten_dense_tensors(flat, tensors)


def foreach_mul_(tensors: list[torch.Tensor], scale) -> None:
    """Every tensor multiplied in place by `scale` in one fused launch (what torch's clip_grad_norm_ calls); were
    it gone, `tensor.mul_(scale)` for each."""
    torch._foreach_mul_(tensors, scale)


# ------------------------------------------------------------------------------------------- collectives
def all_to_all_autograd(tensor: torch.Tensor, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    """All-to-all with uneven splits whose backward runs the all-to-all the other way, waited for (expert
    parallelism's dispatch). torch's functional collectives are private; the public
    `torch.distributed.nn.functional.all_to_all_single` would replace them."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(tensor, output_split_sizes, input_split_sizes, group))


def process_groups() -> list:
    """Every process group this rank has made (the strategy's, DeepSpeed's). torch lists them in its private world
    registry only; were it gone, the groups would have to be recorded as they are made."""
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


def set_group_timeout(timeout: timedelta, group) -> None:
    """The timeout of `group`'s collectives from now on (the hang watchdog moves it with the phase). torch has no
    public setter; without this one, a group keeps the timeout it was made with."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


# ------------------------------------------------------------------------------------------- pipeline stages
def pipeline_stage_class(inferring_shapes):
    """torch's `PipelineStage`, entering `inferring_shapes()` (a context manager) around the forward of placeholder
    activations and the backward of their loss by which torch learns its shapes (`_forward_metadata_inference`,
    `_backward_metadata_inference`, torch >= 2.12: at a schedule's first step and after each evaluation), so that
    no loss or forward hook of ours records them. Were the hook
    renamed, torch's inference would run unnoticed: the test of this name fails first."""
    from torch.distributed.pipelining import PipelineStage  # ~2 s to import: only a pipeline-parallel run pays it

    class Stage(PipelineStage):
        def _forward_metadata_inference(self, *args, **kwargs):
            with inferring_shapes():
                return super()._forward_metadata_inference(*args, **kwargs)

        def _backward_metadata_inference(self, *args, **kwargs):
            with inferring_shapes():
                return super()._backward_metadata_inference(*args, **kwargs)

    return Stage
