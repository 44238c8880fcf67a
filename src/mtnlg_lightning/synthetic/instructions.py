"""A small synthetic instruction set for the fine-tuning demo: chat examples a tiny model can learn in minutes on a
CPU, each answer a function of its question (so "before and after" shows whether fine-tuning took).

The tasks: adding two numbers below 50, reversing a word, upper-casing a word, counting the letters of a word,
naming the next letter of the alphabet. The same `seed` gives the same examples on every machine (no file, no
download); `write_instructions` writes them as OpenAI-style `messages` JSON lines, the form `--data.train` reads.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from mtnlg_lightning.outputs import atomic_write

WORDS = (
    "apple river stone cloud green tiger paper light music ocean bread chair plant smile table water "
    "house dream north south glass honey lemon mouse piano queen robot sugar train violin whale zebra"
).split()
SYSTEM = "You are a careful assistant. Answer with the result only."


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(50), rng.randrange(50)
    return f"What is {a} + {b}?", str(a + b)


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Reverse the word {word}.", word[::-1]


def _upper(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Write {word} in capital letters.", word.upper()


def _length(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"How many letters are in {word}?", str(len(word))


def _next_letter(rng: random.Random) -> tuple[str, str]:
    letter = chr(ord("a") + rng.randrange(25))
    return f"Which letter comes after {letter}?", chr(ord(letter) + 1)


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "add": _add,
    "reverse": _reverse,
    "upper": _upper,
    "length": _length,
    "next_letter": _next_letter,
}


def instruction_examples(count: int = 400, seed: int = 0, system: bool = True) -> list[dict]:
    """`count` chat records (`messages`: an optional system turn, a user question, the assistant's answer), the
    tasks in turn, deterministic in `seed`."""
    rng = random.Random(seed)
    names = list(TASKS)
    records = []
    for index in range(count):
        question, answer = TASKS[names[index % len(names)]](rng)
        turns = [{"role": "system", "content": SYSTEM}] if system else []
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        records.append({"messages": turns})
    return records


def answer_of(question: str) -> str | None:
    """The right answer to one of the set's questions (None for any other text): the demo's scorer."""
    text = question.strip()
    if text.startswith("What is ") and text.endswith("?") and "+" in text:
        left, right = text[len("What is ") : -1].split("+")
        return str(int(left) + int(right))
    if text.startswith("Reverse the word ") and text.endswith("."):
        return text[len("Reverse the word ") : -1][::-1]
    if text.startswith("Write ") and text.endswith(" in capital letters."):
        return text[len("Write ") : -len(" in capital letters.")].upper()
    if text.startswith("How many letters are in ") and text.endswith("?"):
        return str(len(text[len("How many letters are in ") : -1]))
    if text.startswith("Which letter comes after ") and text.endswith("?"):
        return chr(ord(text[len("Which letter comes after ") : -1]) + 1)
    return None


def write_instructions(path: str | Path, count: int = 400, seed: int = 0) -> Path:
    """The set as JSON lines at `path` (written atomically)."""
    path = Path(path)
    with atomic_write(path, "w") as handle:
        for record in instruction_examples(count, seed):
            handle.write(json.dumps(record) + "\n")
    return path
