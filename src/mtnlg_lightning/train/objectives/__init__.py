"""The training objectives by the name `--model.objective` gives (`objective.Objective`): a new one is its module
and its line here."""

from __future__ import annotations

from collections.abc import Mapping

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.train.objectives.grpo import GRPO
from mtnlg_lightning.train.objectives.language_modelling import LanguageModelling
from mtnlg_lightning.train.objectives.objective import Objective
from mtnlg_lightning.train.objectives.preference import Preference

OBJECTIVES: dict[str, type[Objective]] = {"lm": LanguageModelling, "dpo": Preference, "grpo": GRPO}


def build_objective(hparams: Mapping) -> Objective:
    """The objective `hparams["objective"]` names, with its settings read from `hparams` (one line if unknown)."""
    name = hparams["objective"]
    if name not in OBJECTIVES:
        raise MTNLGError(f"model.objective must be one of {', '.join(OBJECTIVES)}, got {name!r}")
    return OBJECTIVES[name].from_hparams(hparams)
