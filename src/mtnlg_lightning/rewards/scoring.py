"""Completions scored by every reward function: a table [completions, functions], as TRL's GRPOTrainer builds it.

Each function is called once on the whole batch with TRL's keywords: `prompts`, `completions`, `completion_ids` and
every column (a list aligned with the completions). Its values become float32 as TRL's `torch.tensor(values,
dtype=torch.float32)` makes them: numbers and bools (True is 1.0), NumPy and one-element tensor scalars; None is NaN
(the function does not apply to that completion: `grpo_loss.group_advantages` skips it). A function that raises,
returns another count of values or a value that is no number stops the run with one MTNLGError line naming the
function and the prompt involved.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Iterable, Sequence

import torch

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.rewards.loading import CALL_ARGUMENTS, RewardFunction, describe_error, source_file

SHOWN_CHARACTERS = 60  # of a prompt, in messages


def shown(prompt, limit: int = SHOWN_CHARACTERS) -> str:
    """A prompt in a message: its text (a conversation's last turn), whitespace collapsed, cut to `limit` characters."""
    if not isinstance(prompt, str):
        turns = [turn for turn in prompt if isinstance(turn, dict)] if isinstance(prompt, list) else []
        prompt = str(turns[-1].get("content", "")) if turns else str(prompt)
    text = " ".join(prompt.split())
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def reward_value(value) -> float | None:
    """A returned value as a float (None: NaN); None when it is no number."""
    if value is None:
        return math.nan
    if isinstance(value, str | bytes):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # a list, a dict, a tensor of several values
        return None


def _returned(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def score(
    functions: Iterable[RewardFunction],
    prompts: Sequence,
    completions: Sequence,
    completion_ids: Sequence,
    columns: dict[str, Sequence],
) -> torch.Tensor:
    """[N, F] float32: reward function f's value for completion n (NaN where it returned None). `prompts`,
    `completions`, `completion_ids` and each column hold one entry per completion (a prompt's repeated for each of
    its completions)."""
    functions = list(functions)
    count = len(completions)
    lengths = {"prompts": len(prompts), "completion_ids": len(completion_ids)}
    lengths.update({f"column {name}": len(values) for name, values in columns.items()})
    uneven = {what: n for what, n in lengths.items() if n != count}
    if uneven:
        raise ValueError(f"{count} completions with {uneven}: every argument needs one entry per completion")
    clash = [name for name in columns if name in CALL_ARGUMENTS]
    if clash:
        raise MTNLGError(
            f"the prompt records have a field {', '.join(clash)}: the reward functions receive the generation under "
            "that name; rename the field"
        )
    table: list[list[float]] = []
    for reward in functions:
        about = f"reward function {reward.name}"
        try:
            values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            if inspect.isawaitable(values):  # TRL's async reward functions: awaited one after another
                values = asyncio.run(values)
        except Exception as error:  # noqa: BLE001 - the user's function, whatever it raises: one line
            raise MTNLGError(
                f"{about} fails on the completions of prompt {shown(prompts[0])}: "
                f"{describe_error(error, source_file(reward.function))}"
            ) from None
        if isinstance(values, str | bytes | dict) or not hasattr(values, "__len__"):
            raise MTNLGError(
                f"{about} returned {type(values).__name__} on the completions of prompt {shown(prompts[0])}; "
                f"expected a list of {count} numbers"
            )
        if len(values) != count:
            raise MTNLGError(
                f"{about} returned {len(values)} values for {count} completions (one each) on the completions of "
                f"prompt {shown(prompts[0])}"
            )
        column = []
        for index, value in enumerate(values):
            number = reward_value(value)
            if number is None:
                raise MTNLGError(
                    f"{about} returned {_returned(value)} for a completion of prompt {shown(prompts[index])}; "
                    "expected a number or None"
                )
            column.append(number)
        table.append(column)
    if not table:
        return torch.empty(count, 0, dtype=torch.float32)
    return torch.tensor(table, dtype=torch.float32).T.contiguous()
