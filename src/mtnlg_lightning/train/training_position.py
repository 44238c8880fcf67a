"""Where training stands in its data: the one owner of the data position.

Three numbers move together and only here: the samples consumed from the blended stream (the data loader starts
there, the checkpoint records it), Lightning's optimizer-step counter (`trainer.global_step`: max_steps, the
checkpoint cadence and the data plan count in it) and the LR schedule's position (a function of consumed samples).
The module moves them after every step, the loss-spike callback moves them over recorded data skips and back to a
checkpoint, the data module and the checkpoint read them: each through `TrainingPosition`.
"""

from __future__ import annotations

from mtnlg_lightning.train import lightning_compat
from mtnlg_lightning.train.lr_batch_schedules import BatchSizeSchedule


class TrainingPosition:
    def __init__(self, batch_schedule: BatchSizeSchedule):
        self.batch_schedule = batch_schedule
        self.consumed_samples = 0  # the start of the next step's global batch in the blended stream

    # ------------------------------------------------------------------ moving forward
    def step_taken(self, trainer, batch_start: int, batch_size: int) -> None:
        """The step over samples [batch_start, batch_start + batch_size) is over, its update applied or vetoed: a
        vetoed update still counts as a step (as Megatron's skipped iterations), so max_steps, the checkpoint
        cadence and the data plan (`consumed_samples(max_steps)`) stay in step with the data."""
        self._move(trainer, batch_start + batch_size, trainer.global_step + 1)

    def skip_to(self, trainer, samples: int) -> int:
        """Jump forward over the samples [consumed_samples, samples) (recorded data skips): each skipped global batch
        counts as a step, as if trained and vetoed. Returns the number of batches skipped."""
        skipped, position = 0, self.consumed_samples
        while position < samples:
            position += self.batch_schedule.batch_size_at_samples(position)
            skipped += 1
        self._move(trainer, samples, trainer.global_step + skipped)
        return skipped

    def _move(self, trainer, samples: int, step: int) -> None:
        self.consumed_samples = samples
        set_global_step(trainer, step)
        for config in trainer.lr_scheduler_configs:  # the LR is a function of consumed_samples: re-evaluated
            config.scheduler.step()

    # ------------------------------------------------------------------ moving back
    def rewind(self, trainer, path: str) -> int:
        """Back to the checkpoint at `path`: model, optimizer, LR schedule and this position, through the strategy
        as Lightning restores a checkpoint but without touching the loops (training goes on in the same epoch).
        Returns the checkpoint's step, which is now `trainer.global_step`."""
        strategy, module = trainer.strategy, trainer.lightning_module
        checkpoint = strategy.load_checkpoint(path)
        module.on_load_checkpoint(checkpoint)  # reads this position back (`load_state_dict`)
        strategy.load_model_state_dict(checkpoint, strict=module.strict_loading)
        if strategy.lightning_restore_optimizer:
            strategy.load_optimizer_state_dict(checkpoint)
        for config, state in zip(trainer.lr_scheduler_configs, checkpoint.get("lr_schedulers", []), strict=False):
            config.scheduler.load_state_dict(state)
        step = int(checkpoint["global_step"])
        set_global_step(trainer, step)
        return step

    # ------------------------------------------------------------------ checkpoint view
    def state_dict(self) -> dict:
        """The keys a checkpoint records (Lightning records the step and the scheduler itself)."""
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, checkpoint: dict) -> None:
        self.consumed_samples = int(checkpoint.get("consumed_samples", 0))


def set_global_step(trainer, step: int) -> None:
    """Write Lightning's step counter: the one place that does. Under manual optimization Lightning counts a step
    only when `LightningOptimizer.step()` runs; the update primitives apply the update without that wrapper (under
    ZeRO the engine applies it; a vetoed update applies nothing), so every step is counted here instead."""
    lightning_compat.set_optimizer_steps(trainer, step)
