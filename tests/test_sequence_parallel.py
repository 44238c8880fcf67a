"""Sequence parallelism's start-up checks and the per-step peak-memory figure (single process; the numerical
equivalence of every SP layout with one process is in test_parallel_equivalence.py)."""

import pytest
import torch

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.parallel.sequence_parallel import check_sequence_length
from mtnlg_lightning.peak_memory import StepPeakMemory
from mtnlg_lightning.strategy import MegatronDeepSpeedStrategy


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
