"""Gopher / C4 heuristic quality rules that annotate instead of destroy.

A document's *signals* (word count, mean word length, duplicate n-gram fractions, ...) are measured once and stored
on the document; a *rule* compares signals with thresholds. Because the rules read only the stored signals, the
thresholds can be changed and the rules re-applied (``mtnlg-quality filter --heuristics --set ...``) without
measuring anything again. Thresholds default to the values Gopher (Rae et al. 2021, appendix A) and C4 (Raffel et
al. 2020) publish.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

_WORD = re.compile(r"\w+", re.UNICODE)
BULLETS = ("•", "‣", "◦", "⁃", "●", "▪", "-", "*", "·")
ELLIPSES = ("...", "…")
# Gopher's stop words: a document must hold at least two of them (English only).
STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
TOP_NGRAMS = (2, 3, 4)
DUPLICATE_NGRAMS = (5, 6, 7, 8, 9, 10)


def _duplicate_fractions(items: list[str]) -> tuple[float, float]:
    """(fraction of items that repeat an earlier one, fraction of their characters), as Gopher counts them."""
    if not items:
        return 0.0, 0.0
    seen: set[str] = set()
    dup = dup_chars = 0
    for item in items:
        if item in seen:
            dup += 1
            dup_chars += len(item)
        seen.add(item)
    total_chars = sum(len(x) for x in items)
    return dup / len(items), dup_chars / max(1, total_chars)


def _top_ngram_char_fraction(words: list[str], n: int, total_chars: int) -> float:
    """Characters in the occurrences of the most frequent n-gram over the characters of all words."""
    if len(words) < n or not total_chars:
        return 0.0
    counts = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    gram, count = counts.most_common(1)[0]
    return count * sum(len(w) for w in gram) / total_chars if count > 1 else 0.0


def _duplicate_ngram_char_fraction(words: list[str], n: int, total_chars: int) -> float:
    """Characters of the words covered by any n-gram that occurs more than once, each word counted once."""
    if len(words) < n or not total_chars:
        return 0.0
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    covered = bytearray(len(words))
    for i, gram in enumerate(grams):
        if counts[gram] > 1:
            covered[i : i + n] = b"\x01" * n
    return sum(len(w) for w, c in zip(words, covered, strict=True) if c) / total_chars


def measure(text: str) -> dict[str, float]:
    """Every signal the rules read, for one document."""
    tokens = text.split()
    words = _WORD.findall(text.lower())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    n_tokens = max(1, len(tokens))
    total_chars = sum(len(w) for w in words)
    signals = {
        "word_count": len(tokens),
        "mean_word_length": sum(len(t) for t in tokens) / n_tokens,
        "symbol_word_ratio": (text.count("#") + sum(text.count(e) for e in ELLIPSES)) / n_tokens,
        "bullet_line_fraction": sum(line.startswith(BULLETS) for line in lines) / max(1, len(lines)),
        "ellipsis_line_fraction": sum(line.endswith(ELLIPSES) for line in lines) / max(1, len(lines)),
        "alpha_word_fraction": sum(any(c.isalpha() for c in t) for t in tokens) / n_tokens,
        "stop_words": sum(w in STOP_WORDS for w in words),
        "lorem_ipsum": float("lorem ipsum" in text.lower()),
    }
    signals["duplicate_line_fraction"], signals["duplicate_line_char_fraction"] = _duplicate_fractions(lines)
    signals["duplicate_paragraph_fraction"], signals["duplicate_paragraph_char_fraction"] = _duplicate_fractions(
        paragraphs
    )
    for n in TOP_NGRAMS:
        signals[f"top_{n}gram_char_fraction"] = _top_ngram_char_fraction(words, n, total_chars)
    for n in DUPLICATE_NGRAMS:
        signals[f"duplicate_{n}gram_char_fraction"] = _duplicate_ngram_char_fraction(words, n, total_chars)
    return {k: round(float(v), 6) for k, v in signals.items()}


@dataclass(frozen=True)
class Rule:
    name: str
    description: str
    defaults: dict[str, float]
    fails: Callable[[dict, dict, str], bool]  # (signals, params, language) -> the document fails the rule


def _english(language: str) -> bool:
    return language in ("", "en")


def _repetition_rule(unit: str, earlier: str) -> Rule:
    """Gopher's rule on repeated lines or paragraphs: the fraction of `unit`s repeating `earlier` above
    max_<unit>s (0.3), or their characters' fraction above max_chars (0.2)."""
    units = f"{unit}s"
    return Rule(
        f"duplicate_{units}",
        f"fraction of {units} repeating {earlier} above max_{units} (Gopher 0.3), or their characters above "
        "max_chars (0.2)",
        {f"max_{units}": 0.3, "max_chars": 0.2},
        lambda s, p, _: (
            s[f"duplicate_{unit}_fraction"] > p[f"max_{units}"] or s[f"duplicate_{unit}_char_fraction"] > p["max_chars"]
        ),
    )


RULES: tuple[Rule, ...] = (
    Rule(
        "word_count",
        "words (whitespace tokens) outside [min, max] (Gopher 50..100,000)",
        {"min": 50, "max": 100_000},
        lambda s, p, _: not p["min"] <= s["word_count"] <= p["max"],
    ),
    Rule(
        "mean_word_length",
        "mean word length outside [min, max] characters (Gopher 3..10)",
        {"min": 3, "max": 10},
        lambda s, p, _: not p["min"] <= s["mean_word_length"] <= p["max"],
    ),
    Rule(
        "symbol_word_ratio",
        "('#' + ellipses) per word above max (Gopher 0.1)",
        {"max": 0.1},
        lambda s, p, _: s["symbol_word_ratio"] > p["max"],
    ),
    Rule(
        "bullet_lines",
        "fraction of lines starting with a bullet above max (Gopher 0.9)",
        {"max": 0.9},
        lambda s, p, _: s["bullet_line_fraction"] > p["max"],
    ),
    Rule(
        "ellipsis_lines",
        "fraction of lines ending in an ellipsis above max (Gopher 0.3)",
        {"max": 0.3},
        lambda s, p, _: s["ellipsis_line_fraction"] > p["max"],
    ),
    Rule(
        "alpha_words",
        "fraction of words with a letter below min (Gopher 0.8)",
        {"min": 0.8},
        lambda s, p, _: s["alpha_word_fraction"] < p["min"],
    ),
    Rule(
        "stop_words",
        "English stop words (the, be, to, of, and, that, have, with) fewer than min (Gopher 2); only for "
        "documents whose language is en or unknown",
        {"min": 2},
        lambda s, p, lang: _english(lang) and s["stop_words"] < p["min"],
    ),
    _repetition_rule("line", "an earlier line"),
    _repetition_rule("paragraph", "an earlier one"),
    Rule(
        "top_ngrams",
        "characters in the most frequent word n-gram above max_N for N = 2, 3, 4 (Gopher 0.20, 0.18, 0.16)",
        {"max_2": 0.20, "max_3": 0.18, "max_4": 0.16},
        lambda s, p, _: any(s[f"top_{n}gram_char_fraction"] > p[f"max_{n}"] for n in TOP_NGRAMS),
    ),
    Rule(
        "duplicate_ngrams",
        "characters in repeated word n-grams above max_N for N = 5..10 (Gopher 0.15, 0.14, ..., 0.10)",
        {f"max_{n}": round(0.15 - 0.01 * (n - 5), 2) for n in DUPLICATE_NGRAMS},
        lambda s, p, _: any(s[f"duplicate_{n}gram_char_fraction"] > p[f"max_{n}"] for n in DUPLICATE_NGRAMS),
    ),
    Rule(
        "lorem_ipsum",
        "the text contains 'lorem ipsum' (C4); no parameter",
        {},
        lambda s, p, _: s["lorem_ipsum"] > 0,
    ),
)
RULES_BY_NAME = {r.name: r for r in RULES}


def rule_settings(overrides: dict[str, float] | None = None, disabled: set[str] | None = None) -> dict[str, dict]:
    """{rule: params} of the enabled rules, defaults overridden by ``{"rule.param": value}``."""
    disabled = disabled or set()
    unknown = disabled - set(RULES_BY_NAME)
    if unknown:
        raise ValueError(f"unknown rule(s) {sorted(unknown)}; rules: {', '.join(RULES_BY_NAME)}")
    settings = {r.name: dict(r.defaults) for r in RULES if r.name not in disabled}
    for key, value in (overrides or {}).items():
        rule, _, param = key.partition(".")
        if rule not in RULES_BY_NAME or param not in RULES_BY_NAME[rule].defaults:
            known = ", ".join(f"{r.name}.{p}" for r in RULES for p in r.defaults)
            raise ValueError(f"unknown threshold {key!r}; thresholds: {known}")
        if rule in settings:
            settings[rule][param] = value
    return settings


def failed_rules(signals: dict, settings: dict[str, dict], language: str = "") -> list[str]:
    """Names of the enabled rules the document fails, in rule order."""
    return [name for name, params in settings.items() if RULES_BY_NAME[name].fails(signals, params, language)]
