"""Reward functions for GRPO, with TRL's signature `fn(prompts, completions, completion_ids, **columns) -> list[float
| None]`: the shipped ones (`builtin`), loading what a run's settings name (`loading`) and scoring a batch of
completions with them (`scoring`). This package imports torch and the standard library only."""

from mtnlg_lightning.rewards.builtin import accuracy, format, length
from mtnlg_lightning.rewards.loading import SHIPPED, RewardFunction, RewardFunctions, load_rewards
from mtnlg_lightning.rewards.scoring import score

__all__ = ["SHIPPED", "RewardFunction", "RewardFunctions", "accuracy", "format", "length", "load_rewards", "score"]
