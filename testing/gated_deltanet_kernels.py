"""Gated DeltaNet's two paths side by side (`mtnlg_lightning.fla_kernels`), for tests/test_fla_kernels.py and the
GPU check's gated_deltanet stage.

`STAND_INS`: the fused kernels' calls (fla's `chunk_gated_delta_rule`, causal-conv1d's `causal_conv1d_fn`) answered
by plain torch, one run at a time with the torch path's own rule and F.conv1d. Run through the layer on a CPU they
check everything around the kernels against the torch path: the batch flattened to one row of runs, the offsets, the
head layout, the scale and normalisation asked for, the state per run, the prefill's conv inputs. They do not check
the kernels: only a GPU with the kernels installed does (`check` and `time_paths` with the installed kernels: the GPU
check's stage, the last test of tests/test_fla_kernels.py).
"""

from __future__ import annotations

import contextlib
import copy
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from mtnlg_lightning import fla_kernels
from mtnlg_lightning.linear_attention import GatedDeltaNet, chunk_gated_delta_rule
from mtnlg_lightning.model import DocumentMask


def _runs(offsets: list[int]) -> list[tuple[int, int]]:
    return list(zip(offsets[:-1], offsets[1:], strict=True))


def stand_in_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None):  # fmt: skip
    """fla's rule by the torch rule, each run alone: the torch rule normalises q and k and scales q by d_k^-1/2
    itself, so the call must ask fla for exactly that."""
    assert use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5 and initial_state is None
    if cu_seqlens is None:
        o, state = chunk_gated_delta_rule(q, k, v, g, beta)
    else:
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.int64, "varlen: one row of runs, int64 offsets"
        runs = _runs(cu_seqlens.tolist())
        parts = [chunk_gated_delta_rule(*(t[:, s:e] for t in (q, k, v, g, beta))) for s, e in runs]
        o, state = torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts])
    return o, state if output_final_state else None


def stand_in_conv(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                  final_states_out=None, activation=None):  # fmt: skip
    """causal-conv1d's call by F.conv1d, each run alone: x [B, C, L] (channel-last memory with seq_idx, which the
    kernel refuses otherwise), weight [C, W] in x's dtype."""
    assert bias is None and initial_states is None and not return_final_states and activation == "silu"
    assert weight.dtype == x.dtype and weight.dim() == 2
    width, rows = weight.shape[-1], []
    for b in range(x.shape[0]):
        if seq_idx is None:
            offsets = [0, x.shape[-1]]
        else:
            assert x.stride(1) == 1 and seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
            change = (torch.nonzero(seq_idx[b, 1:] != seq_idx[b, :-1]).flatten() + 1).tolist()
            offsets = [0, *change, x.shape[-1]]
        runs = [F.pad(x[b : b + 1, :, s:e], (width - 1, 0)) for s, e in _runs(offsets)]
        rows.append(torch.cat([F.conv1d(r, weight.unsqueeze(1), groups=weight.shape[0]) for r in runs], dim=-1))
    return F.silu(torch.cat(rows))


STAND_INS = fla_kernels.Kernels(stand_in_rule, stand_in_conv)


def random_layer(seed: int = 0, heads: tuple[int, int] = (2, 4), dims: tuple[int, int] = (16, 16), hidden: int = 64,
                 kernel: int = 4) -> GatedDeltaNet:  # fmt: skip
    """A random Gated DeltaNet layer of (n_k, n_v) heads of (d_k, d_v), fp32 on CPU. Its decay rates A in
    [e^-4, 1], not the init's [1, 16] (which forgets within a few tokens): some heads carry their state across the
    rule's chunks of 64 and across a document's end, where a missed restart shows."""
    torch.manual_seed(seed)
    config = SimpleNamespace(
        hidden_size=hidden, layernorm_eps=1e-6, linear_num_key_heads=heads[0], linear_num_value_heads=heads[1],
        linear_key_head_dim=dims[0], linear_value_head_dim=dims[1], linear_conv_kernel_dim=kernel,
    )  # fmt: skip
    layer = GatedDeltaNet(config)
    with torch.no_grad():
        layer.decay.A_log.uniform_(-4, 0)
    return layer


def packed_ids(lengths: list[list[int]], device=None) -> torch.Tensor:
    """[B, S] document ids of rows packed with documents of these lengths (each row numbered from 0)."""
    rows = [torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in lengths]
    return torch.stack(rows).to(device)


def forward_backward(layer: GatedDeltaNet, x: torch.Tensor, grad: torch.Tensor, mask=None, kernels=None):
    """(output, input gradient, parameter gradients) of `layer` on `kernels` (None: the torch path)."""
    layer.zero_grad()
    x = x.detach().clone().requires_grad_()
    with fla_kernels.use(kernels):
        out = layer(x, mask=mask)
    (out * grad).sum().backward()
    return out.detach(), x.grad, {name: p.grad.clone() for name, p in layer.named_parameters()}


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """fla's tests' measure: the RMS of the difference over the RMS of the reference."""
    ours, reference = ours.double(), reference.double()
    return ((ours - reference).norm() / reference.norm().clamp_min(1e-30)).item()


# Relative errors the kernels pass at, output and input gradient, against the torch path in fp32 (TF32 off). fp32:
# fla's own tests' 5e-3 (outputs) and 8e-3 to 2e-2 (gradients): fla 0.6 computes the chunk's triangular solve in TF32
# where the GPU has it (SOLVE_TRIL_DOT_PRECISION) and Triton's fp32 dots default to TF32 (10-bit mantissas, ~1e-3).
# bf16: within BF16_FACTOR of the torch path's own bf16 error against fp32 (the GPU size's layer, measured on a
# CPU: 8e-3 output, 9e-3 input gradient), as fla keeps intermediates in bf16 (the normalised q and k, the solved
# chunk matrix) where the torch rule holds fp32; 1e-3, below bf16's rounding, would fail the torch path itself. A
# plumbing error is far above both (the CPU tests' layer with the stand-ins, fp64, measured): a document's state
# not restarted 0.25 (output) / 0.26 (input gradient), its convolution 0.39 / 0.30, value heads grouped the other
# way 1.0 / 0.86.
FP32_TOLERANCE = {"output": 5e-3, "input_grad": 1e-2}
BF16_FACTOR = 3.0
SIZES = {  # (hidden, (n_k, n_v), (d_k, d_v)), rows of document lengths (one per row when not packed)
    # lengths off the kernels' blocks (fla's chunks of 64, causal-conv1d's tiles): their tails are checked too
    "gpu": (512, (2, 4), (128, 128), {"sequence": [[500], [500]], "packed": [[150, 64, 297]]}),
    "cpu": (64, (2, 4), (16, 16), {"sequence": [[100], [100]], "packed": [[30, 41, 29]]}),
}


def _errors(layer, reference, x, grad, mask, kernels) -> dict:
    ours = forward_backward(layer, x, grad, mask, kernels)
    theirs = forward_backward(reference, x.float(), grad.float(), mask)
    return {"output": relative_error(ours[0], theirs[0]), "input_grad": relative_error(ours[1], theirs[1])}


def check(kernels: fla_kernels.Kernels, dtype: torch.dtype, case: str, device: str = "cuda", seed: int = 0) -> dict:
    """The kernels' output and input gradient in `dtype` against the torch path's in fp32, one `case` ("sequence":
    two rows, "packed": a row of three documents) of the `device`'s size: the relative errors, the torch path's
    own in bf16, and whether they pass (`FP32_TOLERANCE`, `BF16_FACTOR`)."""
    hidden, heads, dims, cases = SIZES["gpu" if device == "cuda" else "cpu"]
    lengths = cases[case]
    reference = random_layer(seed, heads, dims, hidden).to(device)
    layer = copy.deepcopy(reference).to(dtype)
    mask = DocumentMask(packed_ids(lengths, device), "blocks") if case == "packed" else None
    generator = torch.Generator(device).manual_seed(seed)
    shape = (len(lengths), sum(lengths[0]), hidden)
    x, grad = (torch.randn(shape, device=device, generator=generator).to(dtype) for _ in range(2))
    with _fp32_means_fp32():
        out = {"kernels": _errors(layer, reference, x, grad, mask, kernels)}
        if dtype == torch.float32:
            out["ok"] = all(out["kernels"][k] < tol for k, tol in FP32_TOLERANCE.items())
        else:
            out["torch"] = _errors(layer, reference, x, grad, mask, None)
            out["ok"] = all(out["kernels"][k] <= BF16_FACTOR * out["torch"][k] for k in out["torch"])
    return out


@contextlib.contextmanager
def _fp32_means_fp32():
    """The torch path's fp32 reference without TF32 (cuBLAS' matmuls, cuDNN's convolution)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def time_paths(kernels: fla_kernels.Kernels, lengths: list[list[int]], size: tuple, dtype=torch.bfloat16,
               device: str = "cuda", repeats: int = 10) -> dict:  # fmt: skip
    """Median milliseconds of one forward and backward of a layer of `size` ((hidden, heads, dims)) on rows of
    documents of `lengths` (one per row: no document ids), on each path, after one warm-up call."""
    hidden, heads, dims = size
    layer = random_layer(0, heads, dims, hidden).to(device, dtype)
    packed = any(len(row) > 1 for row in lengths)
    mask = DocumentMask(packed_ids(lengths, device), "blocks") if packed else None
    x = torch.randn(len(lengths), sum(lengths[0]), hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    times = {}
    for name, chosen in (("torch_ms", None), ("kernels_ms", kernels)):
        samples = []
        for i in range(repeats + 1):
            if x.is_cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            forward_backward(layer, x, grad, mask, chosen)
            if x.is_cuda:
                torch.cuda.synchronize()
            if i:  # the first: Triton's compilation and autotuning, the allocator
                samples.append((time.perf_counter() - started) * 1e3)
        times[name] = sorted(samples)[len(samples) // 2]
    times["speedup"] = times["torch_ms"] / times["kernels_ms"]
    return times
