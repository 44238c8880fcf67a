"""The strategy's import path before the trainer moved into `train/` (round 4): configs written for it keep working.

trainer:
  strategy:
    class_path: mtnlg_lightning.strategy.MegatronDeepSpeedStrategy   # = mtnlg_lightning.train.strategy...
"""

from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy

__all__ = ["MegatronDeepSpeedStrategy"]
