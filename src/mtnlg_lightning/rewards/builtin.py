"""The shipped reward functions (names `accuracy`, `format`, `length` in a run's reward list), with TRL's signature:
each takes the completions (strings, or `[{"role": "assistant", "content": text}]` lists for conversational
prompts) or their token ids, the columns it reads by name, and ignores the rest (`**kwargs`).
"""

from __future__ import annotations

import importlib.util
import math
import re
import threading
from fractions import Fraction

# DeepSeek-R1's format: the reasoning in <think> tags, then the answer in <answer> tags (whitespace between them).
DEFAULT_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"
DEFAULT_LENGTH_TARGET = 256  # tokens: half of GRPOConfig's default max_completion_length
RELATIVE_TOLERANCE = 1e-6  # two numeric answers agree within this share of the larger

_NUMBER_IN_TEXT = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_FRACTION = re.compile(r"\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(\d+)\s*\}")
# What `as_number` reads: a decimal, a small exponent (no 1e999999999 to expand exactly) or a fraction of integers.
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?|[-+]?\d+/\d+")


def completion_text(completion) -> str:
    """A completion's text: the string itself, or the content of the last assistant turn of a conversational one
    (the last turn when none says assistant; text parts of a content list joined)."""
    if isinstance(completion, str):
        return completion
    turns = [turn for turn in completion if isinstance(turn, dict)]
    said = [turn for turn in turns if turn.get("role", "assistant") == "assistant"] or turns
    content = said[-1].get("content") if said else ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` whose braces close, else None."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth = 0
        for at in range(start + len("\\boxed"), len(text)):
            depth += {"{": 1, "}": -1}.get(text[at], 0)
            if depth == 0:
                return text[start + len("\\boxed{") : at]
        start = text.rfind("\\boxed{", 0, start)
    return None


def extracted_answer(text: str) -> str:
    """The answer a completion gives: its last `\\boxed{...}`'s content, else its last number, else its text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1] if numbers else text.strip()


def as_number(text: str) -> Fraction | None:
    """`text` as an exact number when it is one: integers, decimals, `a/b`, `\\frac{a}{b}`, thousands commas, a `$`
    or a trailing `.` around it; None otherwise."""
    text = _FRACTION.sub(r"\1/\2", text.strip().strip("$").strip().rstrip("."))
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(given: str, expected) -> bool:
    """The plain rule: numerically equal (within RELATIVE_TOLERANCE) when both are numbers, else the same text once
    stripped and with runs of whitespace as one space."""
    expected = str(expected)
    a, b = as_number(given), as_number(expected)
    if a is not None and b is not None:
        try:
            return a == b or math.isclose(float(a), float(b), rel_tol=RELATIVE_TOLERANCE)
        except OverflowError:  # beyond a float's range: only exact equality counts
            return False
    return " ".join(given.split()) == " ".join(expected.split())


def _math_verify():
    """The `math_verify` module when it is installed (it judges answers equal as mathematics), else None."""
    if importlib.util.find_spec("math_verify") is None:
        return None
    import math_verify

    return math_verify


def mathematical(text: str) -> bool:
    """Whether an answer is mathematics rather than words: no two letters in a row outside a LaTeX command (math_verify
    reads "Paris" as the product P*a*r*i*s, equal to "Pairs")."""
    return re.search(r"[A-Za-z]{2,}", re.sub(r"\\[A-Za-z]+", " ", text)) is None


def verified(given: str, expected, math_verify) -> bool:
    """math_verify's judgement of `given` (an extracted answer) against `expected`, each read as a boxed answer
    (false when it reads either as nothing). Its timeouts use signals: off outside the main thread (as TRL)."""
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold, answer = (math_verify.parse(f"\\boxed{{{text}}}", parsing_timeout=timeout) for text in (expected, given))
    return bool(gold and answer and math_verify.verify(gold, answer, timeout_seconds=timeout))


def accuracy(completions, answer=None, **kwargs) -> list[float | None]:
    """1.0 where the completion's answer equals the record's `answer` column (TRL's `solution` column when there is
    no `answer`), else 0.0; None where the record has none (not applicable).

    The completion's answer is the content of its last `\\boxed{...}`, else its last number, else its whole text. It
    counts when the plain rule finds it equal: numerically within a relative 1e-6 when both read as numbers (`3/4`,
    `\\frac{3}{4}`, `1,000` and `$5` do), else equal as text once stripped (case counts). With `math_verify`
    installed, an answer that is mathematics (no word in it) also counts when math_verify judges the two equal (`2x+2`
    equals `2(x+1)`, `\\sqrt{4}` equals 2)."""
    expected = answer if answer is not None else kwargs.get("solution")
    if expected is None:
        raise ValueError("the records have no answer column (nor solution): accuracy compares with it")
    checker = _math_verify()
    rewards: list[float | None] = []
    for completion, gold in zip(completions, expected, strict=True):
        if gold is None:
            rewards.append(None)
            continue
        given = extracted_answer(completion_text(completion))
        right = same_answer(given, gold)
        if not right and checker is not None and mathematical(str(gold)):
            right = verified(given, str(gold), checker)
        rewards.append(float(right))
    return rewards


def format(completions, pattern: str = DEFAULT_FORMAT, **kwargs) -> list[float]:
    """1.0 where the whole completion text (stripped) matches the regular expression `pattern` (`.` matches newlines
    too), else 0.0. The default is the DeepSeek-R1 format `<think>...</think><answer>...</answer>` (whitespace
    allowed between the two); e.g. `{name: format, pattern: '<answer>.*</answer>'}` asks for answer tags alone."""
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]


def length(completion_ids, target: int = DEFAULT_LENGTH_TARGET, **kwargs) -> list[float]:
    """A shaping reward for completions of about `target` tokens: 1 - min(1, |n - target| / target) for a completion
    of n tokens, so 1.0 at the target, falling linearly to 0.0 at no tokens and at twice the target and beyond (e.g.
    `{name: length, target: 64}`). Weigh it low beside a correctness reward: on its own it teaches only length."""
    if not (isinstance(target, int | float) and not isinstance(target, bool) and target > 0):
        raise ValueError(f"target must be a number of tokens > 0, got {target!r}")
    return [1.0 - min(1.0, abs(len(ids) - target) / target) for ids in completion_ids]
