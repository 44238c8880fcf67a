"""A small synthetic preference set for the DPO demo and tests: the instruction set's questions (`instructions.py`)
with the right answer chosen and a plausible wrong one rejected (an off-by-one sum, the word unreversed, lower case,
a miscount, the letter before), so a held-out pair's reward accuracy says whether the preference was learned.
Deterministic in `seed`; written as TRL-style JSON lines (`prompt` turns, `chosen` and `rejected` assistant turns).
"""

from __future__ import annotations

import random
from pathlib import Path

from mtnlg_lightning.demo.synthetic.instructions import instruction_examples
from mtnlg_lightning.outputs import write_json_lines


def wrong_answer(question: str, right: str, rng: random.Random) -> str:
    """A near miss of the right answer, never equal to it."""
    if right.isdigit():
        return str(int(right) + rng.choice((-2, -1, 1, 2)) if int(right) > 1 else int(right) + 1)
    if question.startswith("Reverse the word "):
        return question[len("Reverse the word ") : -1]
    if right.isupper():
        return right.lower()
    if len(right) == 1:  # the next letter: answer with the letter asked about
        return chr(ord(right) - 1)
    return right[::-1]


def preference_examples(count: int = 400, seed: int = 0) -> list[dict]:
    """`count` records: `prompt` (system and user turns), `chosen` and `rejected` (one assistant turn each)."""
    rng = random.Random(seed + 1_000_003)
    records = []
    for record in instruction_examples(count, seed):
        *prompt, answer = record["messages"]
        question, right = prompt[-1]["content"], answer["content"]
        wrong = wrong_answer(question, right, rng)
        records.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": right}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
        )
    return records


def write_preferences(path: str | Path, count: int = 400, seed: int = 0) -> Path:
    """The set as JSON lines at `path` (written atomically)."""
    return write_json_lines(path, preference_examples(count, seed))
