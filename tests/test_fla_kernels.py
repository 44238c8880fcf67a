"""Gated DeltaNet on the fused kernels (`fla_kernels`): the packed rows' offsets, the convolution of each document
in torch (CUDA without causal-conv1d), and every call around the kernels checked on CPU against the torch path with
plain-torch stand-ins for the kernels (`testing.gated_deltanet_kernels`): sequences, packed rows of a batch, the
gradients, a prefill and the decoding that continues from it. The kernels themselves only where a CUDA GPU and
flash-linear-attention are (the last test; the GPU check's gated_deltanet stage measures the same)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mtnlg_lightning import fla_kernels
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.linear_attention import document_runs, document_starts
from mtnlg_lightning.model import DocumentMask, KVCache
from testing.gated_deltanet_kernels import (
    STAND_INS,
    check,
    forward_backward,
    packed_ids,
    random_layer,
    stand_in_conv,
    stand_in_rule,
)

LENGTHS = [[30, 41, 29], [70, 30]]  # a row of 3 documents (a chunk of 64 crossed), a row of 2: 100 tokens each


def test_a_packed_row_s_offsets_are_its_documents_and_a_batch_s_rows_follow_each_other():
    (a, b, c), (d, _) = LENGTHS
    starts = document_starts(packed_ids(LENGTHS[:1])).flatten()
    assert fla_kernels.cu_seqlens(starts).tolist() == [0, a, a + b, a + b + c]
    assert fla_kernels.run_index(starts).tolist() == [[0] * a + [1] * b + [2] * c]
    ids = packed_ids(LENGTHS)
    ids[1] = 2  # row 1 is the document row 0 ends with: still a run of its own
    assert fla_kernels.cu_seqlens(document_starts(ids).flatten()).tolist() == [0, a, a + b, 100, 200]
    ids = packed_ids(LENGTHS)
    offsets = fla_kernels.cu_seqlens(document_starts(ids).flatten())
    assert offsets.tolist() == [0, a, a + b, 100, 100 + d, 200] and offsets.dtype == torch.int64
    assert offsets.tolist()[:-1] == [row * 100 + s for row, s, _ in document_runs(ids, 2, 100)]


def test_the_convolution_of_each_document_in_torch_is_the_layer_s_per_document():
    layer = random_layer().double()
    ids = packed_ids(LENGTHS)
    x = torch.randn(2, 100, layer.conv1d.in_channels, dtype=torch.float64)
    expected = torch.zeros_like(x)
    for row, s, e in document_runs(ids, 2, 100):
        expected[row, s:e] = layer._convolve(x[row : row + 1, s:e], None)[0]
    run = fla_kernels.run_index(document_starts(ids).flatten()).view(2, 100)
    torch.testing.assert_close(fla_kernels.conv_per_run(x, layer.conv1d.weight, run), expected, rtol=1e-12, atol=1e-12)
    whole = layer._convolve(x, None)[0]
    torch.testing.assert_close(fla_kernels.conv_per_run(x, layer.conv1d.weight), whole, rtol=1e-12, atol=1e-12)
    short = x[:, :2]  # shorter than the kernel
    torch.testing.assert_close(fla_kernels.conv_per_run(short, layer.conv1d.weight), layer._convolve(short, None)[0])


@pytest.mark.parametrize("conv", ["causal_conv1d", "torch"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "rows"])
def test_the_kernels_calls_give_the_torch_path_s_output_and_gradients(packed, conv):
    """fp64 on CPU, stand-ins answering the kernels' calls: what differs from the torch path is only the plumbing,
    so everything agrees to the rounding of what the layer computes in fp32 whatever its dtype (the rule, the gated
    norm: a row's last token is summed by another loop when the documents are one tensor than when each is its own)."""
    layer = random_layer(heads=(2, 4), dims=(8, 6)).double()  # two value heads per key head, d_k != d_v
    mask = DocumentMask(packed_ids(LENGTHS), "sdpa") if packed else None
    x = torch.randn(2, 100, 64, dtype=torch.float64)
    grad = torch.randn_like(x)
    kernels = STAND_INS if conv == "causal_conv1d" else fla_kernels.Kernels(stand_in_rule)
    out, x_grad, grads = forward_backward(layer, x, grad, mask, kernels)
    ref_out, ref_x_grad, ref_grads = forward_backward(layer, x, grad, mask)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x_grad, ref_x_grad, rtol=1e-6, atol=1e-7)
    for name, g in ref_grads.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-7 * scale, msg=lambda m, n=name: n + m)
    if packed:  # the control: the same call with the documents not restarted is not the torch path
        leaking = DocumentMask(torch.zeros(2, 100, dtype=torch.long), "sdpa")
        assert (forward_backward(layer, x, grad, leaking, kernels)[0] - ref_out).abs().max() > 1e-3


def test_a_prefill_on_the_kernels_continues_as_the_torch_path_s_decoding():
    """The prefill's conv inputs and state (one run per row) are what the torch recurrence steps on from."""
    layer = random_layer().double().eval()
    tokens = torch.randn(2, 70, 64, dtype=torch.float64)
    outs = {}
    for name, kernels in (("kernels", STAND_INS), ("torch", None)):
        cache = KVCache(80).layer("0")
        with torch.no_grad(), fla_kernels.use(kernels):
            steps = [layer(tokens[:, :67], cache=cache)] + [layer(tokens[:, t : t + 1], cache=cache) for t in (67, 68)]
        outs[name] = torch.cat(steps, dim=1), cache.cache.states["0"]
    torch.testing.assert_close(outs["kernels"][0], outs["torch"][0], rtol=1e-6, atol=1e-7)
    for part in ("conv", "state"):
        torch.testing.assert_close(outs["kernels"][1][part], outs["torch"][1][part], rtol=1e-6, atol=1e-7)
    held = outs["kernels"][1]
    assert held["state"].dtype == torch.float64 and held["conv"].shape == (
        2,
        layer.conv1d.in_channels,
        3,
    )  # the state in compute_dtype: fp32, float64 here


def test_the_kernels_keep_the_torch_path_s_refusal_of_branches():
    layer = random_layer()
    ids = packed_ids(LENGTHS)
    ids[0, 50:] = -5  # a branch continuing a prefix document (GRPO's shared prompt)
    with fla_kernels.use(STAND_INS), pytest.raises(MTNLGError, match="cannot continue a prefix document"):
        layer(torch.randn(2, 100, 64), mask=DocumentMask(ids, "blocks"))


def test_on_a_cpu_the_torch_path_runs_and_the_stand_ins_refuse_what_the_kernels_would():
    assert fla_kernels.kernels_for(torch.zeros(1)) is None
    x = torch.randn(1, 8, 4).transpose(1, 2).contiguous()  # channels first: causal-conv1d refuses seq_idx
    with pytest.raises(AssertionError):
        stand_in_conv(x, torch.randn(8, 4), seq_idx=torch.zeros(1, 4, dtype=torch.int32), activation="silu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_check_s_comparison_passes_the_stand_ins_on_a_cpu(dtype):
    """The GPU check's dry run: the same comparison, the torch rule standing in for the kernels."""
    for case in ("sequence", "packed"):
        result = check(STAND_INS, dtype, case, device="cpu")
        assert result["ok"] and result["kernels"]["output"] < (1e-6 if dtype == torch.float32 else 2e-2), result


FLA = importlib.util.find_spec("fla") is not None


@pytest.mark.skipif(not (torch.cuda.is_available() and FLA), reason="needs a CUDA GPU and flash-linear-attention")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["sequence", "packed"])
def test_the_installed_kernels_give_the_torch_path_s_output_and_input_gradients(dtype, case):
    """Against the torch path in fp32, at the tolerances `testing.gated_deltanet_kernels` argues (fla's own tests'
    in fp32, three times the torch path's own error in bf16); the GPU check's gated_deltanet stage runs the same."""
    kernels = fla_kernels.kernels_for(torch.zeros(1, device="cuda"))
    assert kernels is not None, "flash-linear-attention is installed but older than 0.5"
    result = check(kernels, dtype, case)
    assert result["ok"], result
