"""Batch-size ramp-up and the LR schedule: exact arithmetic."""

from itertools import pairwise

import pytest

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.train.flops import flops_per_iteration
from mtnlg_lightning.train.lr_batch_schedules import BatchSizeSchedule, LRSchedule

MTNLG_RAMP = BatchSizeSchedule(1920, 32, 32, 12_000_000_000 // 2048)


def test_mtnlg_ramp_starts_at_32_and_ends_at_1920():
    assert MTNLG_RAMP.batch_size(0) == 32
    assert MTNLG_RAMP.batch_size_at_samples(MTNLG_RAMP.rampup_samples) == 1920
    assert MTNLG_RAMP.batch_size(10**6) == 1920


def test_ramp_grows_by_the_increment_in_equal_sample_slices():
    ramp = BatchSizeSchedule(64, 16, 16, 300)  # 3 increments of 100 samples each
    sizes = [ramp.batch_size(step) for step in range(20)]
    assert sizes[:7] == [16] * 7  # 0..96 consumed
    assert sizes[7] == 32  # 112 consumed >= 100
    assert set(sizes) == {16, 32, 48, 64}
    assert all(b - a in (0, 16) for a, b in pairwise(sizes))


def test_consumed_samples_is_the_exact_sum_of_batch_sizes_across_ramp_boundaries():
    ramp = BatchSizeSchedule(64, 16, 16, 300)
    running = 0
    for step in range(40):
        assert ramp.consumed_samples(step) == running
        running += ramp.batch_size(step)
    first_full = next(s for s in range(40) if ramp.batch_size(s) == 64)
    assert ramp.consumed_samples(first_full) >= 300
    assert ramp.consumed_samples(first_full - 1) < 300


def test_steps_for_samples_inverts_consumed_samples():
    for samples in (0, 1, 16, 17, 100, 299, 300, 1000, 10_000):
        steps = MTNLG_RAMP.steps_for_samples(samples)
        assert MTNLG_RAMP.consumed_samples(steps) >= samples
        assert steps == 0 or MTNLG_RAMP.consumed_samples(steps - 1) < samples


def test_without_ramp_every_step_is_the_global_batch():
    fixed = BatchSizeSchedule(8)
    assert [fixed.consumed_samples(s) for s in range(4)] == [0, 8, 16, 24]


def test_ramp_that_does_not_reach_the_global_batch_by_increments_is_rejected():
    with pytest.raises(MTNLGError, match="multiple of the increment"):
        BatchSizeSchedule(100, 32, 32, 1000)


def test_batch_sizes_must_split_into_micro_batches_per_dp_rank():
    MTNLG_RAMP.check_divisible(micro_batch_size=1, data_parallel_size=32)
    with pytest.raises(MTNLGError, match="not divisible by micro_batch_size 1 x data-parallel size 64"):
        MTNLG_RAMP.check_divisible(micro_batch_size=1, data_parallel_size=64)


def test_lr_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    lr = LRSchedule(lr=5e-5, min_lr=5e-6, warmup_tokens=1_000, decay_tokens=11_000)
    assert lr(0) == 0
    assert lr(500) == pytest.approx(2.5e-5)
    assert lr(1_000) == pytest.approx(5e-5)
    assert lr(6_000) == pytest.approx(5e-6 + 0.5 * 4.5e-5)  # half way: cos(pi/2) = 0
    assert lr(11_000) == pytest.approx(5e-6)
    assert lr(50_000) == 5e-6
    values = [lr(t) for t in range(1_000, 11_001, 500)]
    assert all(a >= b for a, b in pairwise(values))


def test_megatron_flops_formula_reproduces_the_papers_tflops_with_full_recompute():
    # Paper, Table 2: 1920 x 2048 batch, 280/350/420 DGX nodes, 60.1/50.2/44.4 s per iteration.
    config = get_config("mtnlg-530b")
    flops = flops_per_iteration(config, 1920, recompute=True)
    for seconds, nodes, reported in ((60.1, 280, 126), (50.2, 350, 121), (44.4, 420, 113)):
        assert flops / seconds / (nodes * 8) / 1e12 == pytest.approx(reported, rel=0.02)
    assert flops_per_iteration(config, 1) * 96 / 72 == pytest.approx(flops_per_iteration(config, 1, recompute=True))
