"""Sequence parallelism's start-up checks and the per-step peak-memory figure (single process; the numerical
equivalence of every SP layout with one process is in test_parallel_equivalence.py)."""

import pytest
import torch

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.parallel.sequence_parallel import check_sequence_length
from mtnlg_lightning.train.peak_memory import StepPeakMemory
from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy


def test_sequence_length_must_split_evenly_over_the_tensor_parallel_ranks():
    check_sequence_length(2048, 8)
    with pytest.raises(MTNLGError, match="seq_len 2050 is not divisible by tensor_parallel 8"):
        check_sequence_length(2050, 8)


def test_sequence_parallel_without_tensor_parallelism_is_refused():
    strategy = MegatronDeepSpeedStrategy(tensor_parallel=1, sequence_parallel=True, print_layout=False)
    with pytest.raises(MTNLGError, match="sequence_parallel .* needs tensor_parallel > 1"):
        strategy._check_arguments()
    MegatronDeepSpeedStrategy(tensor_parallel=2, sequence_parallel=True, print_layout=False)._check_arguments()


def test_step_peak_memory_sees_a_large_allocation_and_forgets_it_after_a_reset():
    meter = StepPeakMemory(torch.device("cpu"))
    meter.reset()
    before = meter.read_bytes()
    big = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, touched
    during = meter.read_bytes()
    assert during - before >= 0.9 * big.numel() * 4
    del big
    meter.reset()
    if meter.per_step:  # Linux with /proc/self/clear_refs: the peak restarts from what is resident now
        assert meter.read_bytes() < during - 200 * 2**20


def test_sequence_parallel_gpt_matches_one_process_in_loss_and_every_gradient():
    """A whole GPT under TP 2 + SP, ranks as threads: the same loss and, gathered, the same gradients (the
    vocab-parallel loss runs in fp32: fp32 tolerances). Dropout needs one generator per rank: the process launches
    of test_parallel_equivalence.py check it."""
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from threaded_group import run_ranks

    from mtnlg_lightning.config import get_config
    from mtnlg_lightning.model import build_model
    from mtnlg_lightning.parallel.tensor_parallel import (
        apply_tensor_parallel,
        gather_tensor_parallel,
        is_tensor_parallel,
        vocab_parallel_cross_entropy,
    )

    torch.manual_seed(0)
    reference = build_model(get_config("tiny")).double()
    tokens = torch.randint(0, 4096, (2, 65))
    loss = F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()

    def rank_fn(rank):
        group = dist.group.WORLD
        model = apply_tensor_parallel(copy.deepcopy(reference), group, rank, 2, sequence_parallel=True)
        model.zero_grad()
        loss = vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], group)
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            grads[name] = gather_tensor_parallel(p.grad, p.partition_dim, group) if is_tensor_parallel(p) else p.grad
        return loss.detach(), grads

    expected = {name: p.grad for name, p in reference.named_parameters()}
    for rank_loss, grads in run_ranks(2, rank_fn):
        assert rank_loss.item() == pytest.approx(loss.item(), rel=1e-6)
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():  # LayerNorm and row-bias gradients summed over the sequence shards
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
