"""Scaled dot-product attention on the kernel that suits the device and the shape: `sdpa` is
`F.scaled_dot_product_attention` with the same arguments and results; only which of torch's kernels computes it
may differ. The model's attention calls it (the context-parallel ring calls torch's flash kernels itself, for their
log-sum-exp: `torch_compat.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# torch's CPU flash-attention kernel works in fixed blocks: in bf16 or fp16 a short row costs about what a row of 128
# positions does (forward + backward, 7 rows x 9 heads of 80 positions, bf16, one AVX512-AMX core: flash 27 ms, the math
# kernel 12 ms; at 40 positions 15.6 and 4.5 ms; at 256 flash is ahead, 16 against 21 ms). Unpacked fine-tuning rows,
# cut to their micro-batch's longest, are that short: below this many keys a CPU runs the math kernel. fp32 and CUDA
# are unchanged.
CPU_FLASH_MIN_KEYS = 128


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention, on the kernel that is fastest for short half-precision rows on a CPU."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and k.shape[2] < CPU_FLASH_MIN_KEYS:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)
