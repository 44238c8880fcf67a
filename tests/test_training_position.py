"""TrainingPosition: the one owner of consumed samples, Lightning's step counter and the LR-schedule position."""

from __future__ import annotations

from pathlib import Path

import lightning as L

from mtnlg_lightning.train.module import MTNLGModule
from mtnlg_lightning.train.training_position import set_global_step

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "mtnlg_lightning"


def test_skipping_data_counts_each_skipped_global_batch_of_the_ramp_as_a_step():
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module = MTNLGModule(preset="tiny", micro_batch_size=4, global_batch_size=16, rampup_batch_size=[4, 4, 24])
    trainer.strategy.connect(module)  # global_step reads the manual-optimization counter the position writes
    position = module.position  # ramp: 4, 4, 8, 12, then 16 per step
    position.consumed_samples = 4
    assert position.skip_to(trainer, 28) == 3  # [4, 8), [8, 16), [16, 28)
    assert position.consumed_samples == 28 and trainer.global_step == 3
    position.step_taken(trainer, 28, 16)  # a trained (or vetoed) step counts once
    assert position.consumed_samples == 44 and trainer.global_step == 4
    set_global_step(trainer, 2)  # a rewind to a checkpoint of step 2
    assert trainer.global_step == 2


def test_lightnings_step_counter_has_one_writer_in_the_package():
    writers = sorted(
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if "optim_step_progress" in path.read_text()
    )
    assert writers == ["train/lightning_compat.py"]
