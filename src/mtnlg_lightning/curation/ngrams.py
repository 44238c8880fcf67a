"""Task n-grams and the cutting rule of downstream-task decontamination (MT-NLG; Megatron-LM
``tools/openwebtext/filter_ngrams.py``). The passes over the training data are in :mod:`.decontaminate_stages`.

Semantics and the deliberate differences from Megatron's script: docs/curation.md ("Decontamination semantics").
"""

from __future__ import annotations

import itertools
import re
from collections import Counter

import numpy as np
import xxhash

from mtnlg_lightning.corpora.jsonl import InputError
from mtnlg_lightning.corpora.readers import iter_records
from mtnlg_lightning.corpora.sources import expand_inputs, stem

WORD_RE = re.compile(r"\w+")
SENTENCE_END = ".!?"
_P = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the rolling n-gram hash
_MIX = np.uint64(0xFF51AFD7ED558CCD)


def words_of(text: str) -> list[str]:
    return WORD_RE.findall(text.lower())


def words_and_spans(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """Lowercased ``\\w+`` words and their (start, end) character spans in the *original* text."""
    lowered = text.lower()
    matches = list(WORD_RE.finditer(lowered))
    words = [m.group(0) for m in matches]
    if len(lowered) == len(text):
        return words, [m.span() for m in matches]
    # rare: lowercasing changed the length (e.g. 'İ'); map lowered offsets back to the original text
    back = []
    for i, ch in enumerate(text):
        back.extend([i] * len(ch.lower()))
    back.append(len(text))
    return words, [(back[m.start()], back[m.end() - 1] + 1) for m in matches]


def split_text(text: str, start: int, end: int, window: int) -> tuple[str, str]:
    """Megatron's split: cut ``window`` chars before ``start`` / after ``end``, extended outward to a sentence end.

    The first part ends with (and includes) the sentence-end character at or before ``start - window``; it is
    empty if there is none after position 0.  The second part starts just after the first sentence-end character
    at or after ``end + window``; it is empty if there is none (or nothing follows it).
    """
    pos = start - window
    first = ""
    while pos > 0 and text[pos] not in SENTENCE_END:
        pos -= 1
    if pos > 0:
        first = text[: pos + 1]
    pos = end + window
    second = ""
    while pos < len(text) and text[pos] not in SENTENCE_END:
        pos += 1
    if pos + 1 < len(text):
        second = text[pos + 1 :]
    return first, second


def _word_value(word: str) -> int:
    return xxhash.xxh3_64_intdigest(word.encode("utf-8")) | 1


class TaskNgrams:
    """Index of task n-grams: exact tuple lookup behind a vectorised rolling-hash + bit-table prefilter."""

    def __init__(self, max_ngram: int = 13, min_ngram: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.ids: dict[tuple[str, ...], int] = {}
        self.ngrams: list[tuple[str, ...]] = []
        self.task_sets: list[set[int]] = []
        self.task_names: list[str] = []
        self.task_texts: Counter = Counter()
        self._task_index: dict[str, int] = {}
        self._built = False

    # -- building ------------------------------------------------------------------------------------------
    def add(self, task: str, text: str) -> int:
        """Add one task text; returns the number of n-grams it contributed (new or not)."""
        t = self._task_index.get(task)
        if t is None:
            t = self._task_index[task] = len(self.task_names)
            self.task_names.append(task)
        self.task_texts[task] += 1
        words = words_of(text)
        if len(words) < self.min_ngram:
            return 0
        grams = [tuple(words)] if len(words) < self.max_ngram else []
        m = self.max_ngram
        grams += [tuple(words[i : i + m]) for i in range(len(words) - m + 1)]
        for g in grams:
            i = self.ids.get(g)
            if i is None:
                i = self.ids[g] = len(self.ngrams)
                self.ngrams.append(g)
                self._sets().append(set())
            self._sets()[i].add(t)
        self._built = False
        return len(grams)

    def build(self) -> None:
        self.vocab: dict[str, int] = {}
        for g in self.ngrams:
            for w in g:
                if w not in self.vocab:
                    self.vocab[w] = _word_value(w)
        by_len: dict[int, list[int]] = {}
        for g in self.ngrams:
            h = 0
            for w in g:
                h = (h * int(_P) + self.vocab[w]) & 0xFFFFFFFFFFFFFFFF
            by_len.setdefault(len(g), []).append(h)
        # membership prefilter: one bit per slot of a table ~64x larger than the n-gram count (false positive
        # rate <= ~1.6%, each false positive costs one exact dict lookup)
        self.filter_bits = int(min(30, max(16, np.ceil(np.log2(max(1, len(self.ngrams)) * 64)))))
        self.filter = np.zeros(1 << self.filter_bits, dtype=bool)
        for n, hs in by_len.items():
            self.filter[self._slots(np.asarray(hs, dtype=np.uint64), n)] = True
        self.lengths = sorted(by_len)
        self.length_set = set(self.lengths)
        # at one start position: the max length first, then the others ascending (Megatron's order)
        self.check_order = sorted(self.lengths, key=lambda n: (n != self.max_ngram, n))
        self.length_rank = {n: r for r, n in enumerate(self.check_order)}
        self.ngram_len = np.asarray([len(g) for g in self.ngrams], dtype=np.int32)
        self._built = True

    def _slots(self, h: np.ndarray, n: int) -> np.ndarray:
        salt = np.uint64((n * 0xD6E8FEB86659FD93) & 0xFFFFFFFFFFFFFFFF)
        return ((h + salt) * _MIX) >> np.uint64(64 - self.filter_bits)

    def __len__(self) -> int:
        return len(self.ngrams)

    # -- shipping to other processes -----------------------------------------------------------------------
    # The Ray engine pickles the index once per run and every worker unpickles it before its first task, both on
    # the stage's critical path. ``ids`` holds the same tuples as ``ngrams`` and is rebuilt from it faster than
    # it unpickles; the per-n-gram task sets travel as two flat arrays (CSR) and become sets only when needed.
    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in ("ids", "task_sets")}
        sets = self._sets()
        state["_task_indptr"] = np.cumsum([0] + [len(t) for t in sets], dtype=np.int64)
        state["_task_indices"] = np.fromiter(itertools.chain.from_iterable(sets), dtype=np.int32)
        state["task_sets"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.ids = dict(zip(self.ngrams, range(len(self.ngrams)), strict=True))

    def _sets(self) -> list[set[int]]:
        if self.task_sets is None:
            ptr, idx = self._task_indptr.tolist(), self._task_indices.tolist()
            self.task_sets = [set(idx[ptr[i] : ptr[i + 1]]) for i in range(len(self.ngrams))]
        return self.task_sets

    # -- matching ------------------------------------------------------------------------------------------
    def hits(self, words: list[str]) -> list[tuple[int, int]]:
        """All ``(start word, ngram id)`` windows of ``words`` that are task n-grams (verified exactly)."""
        if not self._built:
            self.build()
        if not words or not self.ngrams:
            return []
        v = np.fromiter(map(self.vocab.get, words, itertools.repeat(0)), dtype=np.uint64, count=len(words))
        if not v.any():
            return []
        out: list[tuple[int, int]] = []
        h = v.copy()
        ids = self.ids
        for n in range(1, min(self.max_ngram, len(words)) + 1):
            if n > 1:
                h = h[:-1] * _P + v[n - 1 :]
            if n not in self.length_set:
                continue
            for pos in np.flatnonzero(self.filter[self._slots(h, n)]).tolist():
                gid = ids.get(tuple(words[pos : pos + n]))
                if gid is not None:
                    out.append((pos, gid))
        return out

    def first_match(self, words: list[str], active: np.ndarray | None) -> tuple[int, int] | None:
        """The match Megatron's scan finds first: earliest start word, then length in ``check_order``."""
        best = None
        for pos, gid in self.hits(words):
            if active is not None and not active[gid]:
                continue
            key = (pos, self.length_rank[int(self.ngram_len[gid])])
            if best is None or key < best[0]:
                best = (key, (pos, gid))
        return None if best is None else best[1]

    def ngram_text(self, gid: int) -> str:
        return " ".join(self.ngrams[gid])

    def tasks_of(self, gid: int) -> list[str]:
        return sorted(self.task_names[t] for t in self._sets()[gid])


def clean_text(
    text: str, index: TaskNgrams, active: np.ndarray | None, window: int = 200, min_piece: int = 200
) -> tuple[list[str], list[int]]:
    """Remove task n-grams from one text. Returns (pieces kept, ids of the n-grams that caused cuts)."""
    pieces: list[str] = []
    matched: list[int] = []
    rest: str | None = text
    while rest is not None:
        t, rest = rest, None
        words, spans = words_and_spans(t)
        m = index.first_match(words, active)
        if m is None:
            pieces.append(t)
            break
        pos, gid = m
        matched.append(gid)
        n = len(index.ngrams[gid])
        first, second = split_text(t, spans[pos][0], spans[pos + n - 1][1], window)
        if len(first) > min_piece:
            pieces.append(first)
        if len(second) > min_piece:
            rest = second
    return pieces, matched


# ----------------------------------------------------------------------------------------------------------
# Loading tasks


def load_tasks(paths: list[str], max_ngram: int = 13, min_ngram: int = 8) -> TaskNgrams:
    """Task texts from files, folders or globs in any corpus format (:mod:`mtnlg_lightning.corpora`); a
    record's ``task`` defaults to its file's name without the format suffixes."""
    index = TaskNgrams(max_ngram, min_ngram)
    for file in expand_inputs(paths):
        n = 0
        for rec in iter_records([file], "text", "task"):
            index.add(str(rec.data.get("task", stem(file.name))), rec.text)
            n += 1
        if n == 0:
            raise InputError(f"{file.path}: empty input (no task records)")
    if not len(index):
        raise InputError(f"no task n-grams: every task text has fewer than --min-ngram={min_ngram} words")
    index.build()
    return index
