"""A small LAMBADA-format cloze set from held-out text: passages whose last word is the thing to predict.

Paragraphs of the held-out documents (the validation and test splits of the demo corpus: the model never trained
on them) with `min_words`..`max_words` words, whitespace collapsed to single spaces, cut after their last purely
alphabetic word of 3+ letters that ends a sentence (LAMBADA's targets are bare words, no trailing punctuation).
"""

from __future__ import annotations

import re

WORD = re.compile(r"^[A-Za-z]{3,}$")


def cloze_passage(paragraph: str, min_words: int, max_words: int) -> str | None:
    words = paragraph.split()
    for end in range(min(len(words), max_words), min_words - 1, -1):
        last = words[end - 1]
        if last.endswith(".") and WORD.match(last[:-1]):
            last = last[:-1]
            return " ".join(words[: end - 1] + [last])
    return None


def cloze_passages(documents, count: int, min_words: int = 20, max_words: int = 80) -> list[str]:
    out = []
    for doc in documents:
        for paragraph in re.split(r"\n\s*\n", doc):
            passage = cloze_passage(paragraph, min_words, max_words)
            if passage is not None:
                out.append(passage)
                if len(out) == count:
                    return out
    return out
