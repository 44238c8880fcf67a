"""`sdpa` is F.scaled_dot_product_attention on the kernel that suits the shape: on a CPU, bf16 or fp16 rows shorter
than CPU_FLASH_MIN_KEYS keys run the math kernel (torch's CPU flash kernel costs a short half-precision row about what
a row of 128 costs); every other call is torch's own choice, unchanged."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtnlg_lightning.sdpa import CPU_FLASH_MIN_KEYS, sdpa


def qkv(length: int, dtype: torch.dtype):
    torch.manual_seed(0)
    return [torch.randn(3, 4, length, 16, dtype=dtype) for _ in range(3)]


def on(backend: SDPBackend, q, k, v, **kwargs):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_half_precision_rows_run_the_math_kernel_on_a_cpu(dtype):
    q, k, v = qkv(CPU_FLASH_MIN_KEYS - 8, dtype)
    assert torch.equal(sdpa(q, k, v, is_causal=True), on(SDPBackend.MATH, q, k, v, is_causal=True))
    assert not torch.equal(sdpa(q, k, v, is_causal=True), on(SDPBackend.FLASH_ATTENTION, q, k, v, is_causal=True))


@pytest.mark.parametrize(("length", "dtype"), [(CPU_FLASH_MIN_KEYS, torch.bfloat16), (40, torch.float32)])
def test_long_rows_and_fp32_keep_torchs_choice(length, dtype):
    q, k, v = qkv(length, dtype)
    assert torch.equal(sdpa(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True))
