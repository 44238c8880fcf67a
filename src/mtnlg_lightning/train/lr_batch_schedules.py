"""The MT-NLG training schedules: batch-size ramp-up by samples, LR warmup and cosine decay by tokens.

Both are pure functions of the optimizer step, so every rank, every layout and a resumed run agree exactly.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from mtnlg_lightning.errors import MTNLGError


@dataclass
class BatchSizeSchedule:
    """Global batch size per step, in sequences.

    Megatron's `--rampup-batch-size START INCREMENT RAMP_SAMPLES`: the batch grows from `start` by `increment`
    in equal slices of `ramp_samples` consumed samples until it reaches `global_batch_size`.
    MT-NLG: 32 -> 1920 by 32 over the first 12B tokens (12e9 / 2048 = 5,859,375 samples).
    """

    global_batch_size: int
    rampup_start: int | None = None
    rampup_increment: int | None = None
    rampup_samples: int = 0

    def __post_init__(self) -> None:
        self._consumed = [0]  # consumed samples before step i, grown lazily
        if self.rampup_start is None:
            return
        if self.rampup_increment is None or self.rampup_increment <= 0:
            raise MTNLGError("batch ramp-up needs a positive rampup_increment")
        span = self.global_batch_size - self.rampup_start
        if span < 0 or span % self.rampup_increment:
            raise MTNLGError(
                f"global batch {self.global_batch_size} minus ramp start {self.rampup_start} must be a "
                f"non-negative multiple of the increment {self.rampup_increment}"
            )

    @property
    def _num_increments(self) -> int:
        return (self.global_batch_size - self.rampup_start) // self.rampup_increment

    def batch_size_at_samples(self, consumed_samples: int) -> int:
        if self.rampup_start is None or consumed_samples >= self.rampup_samples or self._num_increments == 0:
            return self.global_batch_size
        samples_per_increment = self.rampup_samples / self._num_increments
        steps_up = int(consumed_samples / samples_per_increment)
        return min(self.rampup_start + steps_up * self.rampup_increment, self.global_batch_size)

    def consumed_samples(self, step: int) -> int:
        """Samples consumed by the first `step` optimizer steps (exact)."""
        if self.rampup_start is None:
            return step * self.global_batch_size
        consumed = self._consumed
        while len(consumed) <= step:
            last = consumed[-1]
            if last >= self.rampup_samples:  # past the ramp: closed form from here
                done = len(consumed) - 1
                return last + (step - done) * self.global_batch_size
            consumed.append(last + self.batch_size_at_samples(last))
        return consumed[step]

    def batch_size(self, step: int) -> int:
        return self.batch_size_at_samples(self.consumed_samples(step))

    def steps_for_samples(self, samples: int) -> int:
        """Smallest number of steps that consumes at least `samples`."""
        if self.rampup_start is None:
            return math.ceil(samples / self.global_batch_size)
        self.consumed_samples(1)
        while self._consumed[-1] < min(samples, self.rampup_samples):
            self.consumed_samples(len(self._consumed))
        if samples <= self._consumed[-1]:
            return bisect.bisect_left(self._consumed, samples)
        done = len(self._consumed) - 1
        return done + math.ceil((samples - self._consumed[-1]) / self.global_batch_size)

    def check_divisible(self, micro_batch_size: int, data_parallel_size: int) -> None:
        unit = micro_batch_size * data_parallel_size
        sizes = {self.global_batch_size}
        if self.rampup_start is not None:
            sizes |= {self.rampup_start, self.rampup_increment}
        for size in sorted(sizes):
            if size % unit:
                raise MTNLGError(
                    f"batch size {size} is not divisible by micro_batch_size {micro_batch_size} x "
                    f"data-parallel size {data_parallel_size} = {unit}"
                )


@dataclass
class LRSchedule:
    """Linear warmup over `warmup_tokens`, then cosine decay to `min_lr` at `decay_tokens` (then constant)."""

    lr: float
    min_lr: float
    warmup_tokens: int
    decay_tokens: int

    def __call__(self, consumed_tokens: int) -> float:
        if self.warmup_tokens > 0 and consumed_tokens < self.warmup_tokens:
            return self.lr * consumed_tokens / self.warmup_tokens
        if consumed_tokens >= self.decay_tokens:
            return self.min_lr
        progress = (consumed_tokens - self.warmup_tokens) / max(1, self.decay_tokens - self.warmup_tokens)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
