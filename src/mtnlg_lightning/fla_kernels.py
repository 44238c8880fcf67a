"""Gated DeltaNet's fused kernels on CUDA, where installed (`pip install 'mtnlg-lightning[linear-attention-kernels]'`):
flash-linear-attention's chunked gated delta rule (Triton) and causal-conv1d's depthwise causal convolution (CUDA),
called as transformers' Qwen3-Next calls them. Neither is required: `linear_attention.py` keeps its plain torch path
wherever the input is not on CUDA or flash-linear-attention (>= 0.5) does not import, and that path is the reference
the kernels are checked against (benchmarks/gpu_check.py, stage gated_deltanet).

Packed rows: the kernels take the batch as one row of its runs (each document of each row), [1, B * S] tokens;
`cu_seqlens` (the runs' offsets, [N + 1]) restarts the rule's state at each run and `seq_idx` (each token's run)
restarts the convolution, which the torch path does with a python loop over `document_runs`. Rows that are one
sequence each keep their [B, S] batch (no offsets).

What the rule is given is what the torch rule computes from: q and k as the convolution leaves them, L2-normalised
inside the kernel (`use_qk_l2norm_in_kernel`: x / sqrt(sum x^2 + 1e-6), our `l2norm`), the scale d_k^-1/2, g the
fp32 log decay, beta, and the n_v value heads grouped n_v / n_k per key head (fla >= 0.5 reads value head h's key
head as h // (n_v / n_k), the torch rule's repeat_interleave). Its output is in q's dtype (q, k and v are splits of
one tensor: v's dtype) and its final state fp32, the torch rule's contract. Precision is not the torch rule's: in
bf16 fla holds some intermediates in bf16 (the normalised q and k, the solved chunk matrix) where the torch rule
holds fp32, and fp32 inputs go through TF32 dots where the GPU has them (fla 0.6 asks for TF32 in the chunk's
triangular solve; Triton's fp32 dots default to it), about 1e-3 relative.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FLA_MIN_VERSION = (0, 5)  # the rule takes fewer key heads than value heads (GVA) from flash-linear-attention 0.5
CONV_WIDTHS = (2, 3, 4)  # the kernel widths causal-conv1d compiles
INSTALL_HINT = "pip install 'mtnlg-lightning[linear-attention-kernels]'"


@dataclass(frozen=True)
class Kernels:
    """The rule (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`'s call) and the convolution
    (`causal_conv1d.causal_conv1d_fn`'s; None: `conv_per_run` in torch, causal-conv1d not installed)."""

    rule: Callable
    conv: Callable | None = None


_AUTO = object()
_chosen: object = _AUTO  # `use`'s choice, or _AUTO: the kernels where installed and the input on CUDA
_found: object = _AUTO  # the installed kernels (None: none), looked for on the first CUDA call


def kernels_for(x: torch.Tensor) -> Kernels | None:
    """The kernels Gated DeltaNet runs `x` on, or None: its torch path (not on CUDA, or fla not installed)."""
    if _chosen is not _AUTO:
        return _chosen
    if not x.is_cuda:
        return None
    if _found is _AUTO:
        _look()
    return _found


@contextlib.contextmanager
def use(kernels: Kernels | None) -> Iterator[None]:
    """Gated DeltaNet runs on `kernels` inside, whatever the device and what is installed; None: its torch path
    even where the kernels are installed (the GPU check's reference beside the kernels)."""
    global _chosen
    before, _chosen = _chosen, kernels
    try:
        yield
    finally:
        _chosen = before


@torch.compiler.disable  # imports and one line of output, once: nothing for a compiled block to trace
def _look() -> None:
    global _found
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        _found = None
        _announce(f"Gated DeltaNet on CUDA: the plain torch rule (no flash-linear-attention: {INSTALL_HINT})")
        return
    version = tuple(int(part) for part in fla.__version__.split(".")[:2] if part.isdigit())
    if version < FLA_MIN_VERSION:
        _found = None
        _announce(
            f"Gated DeltaNet on CUDA: the plain torch rule (flash-linear-attention {fla.__version__} is older than "
            f"{'.'.join(map(str, FLA_MIN_VERSION))}, whose rule groups value heads per key head: {INSTALL_HINT})"
        )
        return
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        causal_conv1d_fn = None
    _found = Kernels(chunk_gated_delta_rule, causal_conv1d_fn)
    conv = "causal-conv1d's convolution" if causal_conv1d_fn else "the convolution in torch (no causal-conv1d)"
    _announce(f"Gated DeltaNet on CUDA: flash-linear-attention {fla.__version__}'s chunked rule, {conv}")


def _announce(line: str) -> None:
    """One line on rank 0: through Lightning's rank_zero_info where Lightning runs the process, else on stderr
    (mtnlg-generate and mtnlg-eval ranks do not import Lightning, and should not for one line)."""
    if "lightning.pytorch" in sys.modules:
        from lightning.pytorch.utilities.rank_zero import rank_zero_info

        rank_zero_info(line)
    elif os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)


def cu_seqlens(starts: torch.Tensor) -> torch.Tensor:
    """The runs' offsets in the flattened row, [0, ..., B * S] (int64, as fla takes them)."""
    return F.pad(starts.nonzero().flatten(), (0, 1), value=starts.numel())


def run_index(starts: torch.Tensor) -> torch.Tensor:
    """Each token's run, 0 to N - 1, [1, B * S] (int32: causal-conv1d's `seq_idx`)."""
    return (starts.cumsum(0, dtype=torch.int32) - 1).unsqueeze(0)


def conv_per_run(x: torch.Tensor, weight: torch.Tensor, run: torch.Tensor | None = None) -> torch.Tensor:
    """silu(the depthwise causal convolution of each run alone), x [B, L, C], weight [C, 1, W], `run` [B, L] each
    token's run (None: one run per row) -> [B, L, C] in x's dtype. Tap W - 1 - j reads the token j back, from the
    same run only (the torch path's zeros before a document); summed in fp32 at least."""
    sums = torch.promote_types(x.dtype, torch.float32)  # bf16 summed in fp32, fp64 kept
    taps, xf = weight[:, 0].to(sums), x.to(sums)
    out = xf * taps[:, -1]
    for back in range(1, min(weight.shape[-1], x.shape[1])):
        earlier = xf[:, :-back]
        if run is not None:
            earlier = earlier * (run[:, back:] == run[:, :-back]).unsqueeze(-1)
        out = out + F.pad(earlier, (0, 0, back, 0)) * taps[:, -1 - back]
    return F.silu(out).to(x.dtype)


def convolve(kernels: Kernels, x: torch.Tensor, weight: torch.Tensor, run: torch.Tensor | None) -> torch.Tensor:
    """`conv_per_run` on causal-conv1d where it is installed and compiled for the width."""
    if kernels.conv is None or weight.shape[-1] not in CONV_WIDTHS:
        return conv_per_run(x, weight, run)
    # causal-conv1d reads [B, C, L]; with seq_idx only channel-last ([B, L, C] memory), which a transposed view is
    channels = x.contiguous().transpose(1, 2)
    seq_idx = None if run is None else run.contiguous()
    # the weight in x's dtype, as autocast gives the torch path's F.conv1d
    out = kernels.conv(channels, weight[:, 0].to(x.dtype), None, seq_idx=seq_idx, activation="silu")
    return out.transpose(1, 2)


def chunk_rule(kernels: Kernels, q, k, v, g, beta, offsets: torch.Tensor | None, final_state: bool = False):
    """`linear_attention.chunk_gated_delta_rule` on fla: q, k [B, L, n_k, d_k], v [B, L, n_v, d_v], g, beta
    [B, L, n_v] (B = 1 with `offsets`, fla's cu_seqlens) -> (o [B, L, n_v, d_v], the final state per row or run
    [N, n_v, d_k, d_v] fp32, or None without `final_state`)."""
    return kernels.rule(
        q,
        k,
        v,
        g=g,
        beta=beta,
        scale=q.shape[-1] ** -0.5,
        initial_state=None,
        output_final_state=final_state,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=offsets,
    )
