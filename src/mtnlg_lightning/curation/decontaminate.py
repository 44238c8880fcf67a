"""Downstream-task decontamination of training data (MT-NLG; Megatron-LM ``tools/openwebtext/filter_ngrams.py``).

Semantics:

* Words are the ``\\w+`` runs of the lowercased text (character offsets refer to the original text).
* Task n-grams: every ``max_ngram``-word (13) window of a task text; a task text of ``min_ngram``..``max_ngram-1``
  (8-12) words is used whole; shorter task texts are ignored.
* Pass 1 counts, for every task n-gram, the number of training documents that contain it; n-grams found in
  ``>= frequent_threshold`` documents are common phrases and are ignored.
* Pass 2 scans each document for the first remaining n-gram (earliest start word; at one start the
  ``max_ngram`` window is tried first, then shorter lengths ascending, as Megatron does), removes it plus
  ``window`` (200) characters on each side extended outward to the nearest sentence end (``.``, ``!``, ``?``),
  keeps the text before it as a piece if longer than ``min_piece`` (200) characters, and rescans the text after
  it (kept only if longer than ``min_piece``).  A document left with more than ``max_splits`` (10) pieces is
  dropped; so is one with no piece left.  Every output record keeps the source record's fields with the text
  replaced by the piece and a ``split_id`` (``<tasks>-<doc number:010d>-<piece:04d>``, prefixed by an existing
  ``split_id``), like Megatron's.

Deliberate differences from Megatron's script (all bug fixes, documented in docs/curation.md): the end of a match
is the end of its last word in the original text (Megatron adds the length of the space-joined words, off when
words are separated by more than one character); every window is checked, including in texts of fewer than 14
words (Megatron skips those) and at the tail in position order; pass 1 counts every occurrence per document
(Megatron's greedy scan skips n-grams that overlap an earlier match).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import re
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import xxhash

from .jsonl import InputError, atomic_write, check_input_files, iter_lines, parse_record, write_json_atomic

WORD_RE = re.compile(r"\w+")
SENTENCE_END = ".!?"
_P = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier of the rolling n-gram hash
_MIX = np.uint64(0xFF51AFD7ED558CCD)
_HIT_LIST_LIMIT = 10000


@dataclass
class DecontamConfig:
    tasks: list[str]
    input: str
    output: str
    report: str | None = None
    text_key: str = "text"
    id_key: str = "id"
    max_ngram: int = 13
    min_ngram: int = 8
    window: int = 200
    min_piece: int = 200
    max_splits: int = 10
    frequent_threshold: int = 10
    workers: int = 1
    progress: bool = True
    chunk_lines: int = 512

    def report_path(self) -> str:
        return self.report or os.path.join(os.path.dirname(os.path.abspath(self.output)), "report.json")


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
                self.task_sets.append(set())
            self.task_sets[i].add(t)
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

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("vocab", "filter", "filter_bits", "lengths", "length_set", "check_order", "length_rank", "ngram_len"):
            state.pop(k, None)
        state["_built"] = False
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.ngrams:
            self.build()

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
        return sorted(self.task_names[t] for t in self.task_sets[gid])


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
    check_input_files(paths)
    index = TaskNgrams(max_ngram, min_ngram)
    for path in paths:
        default = os.path.splitext(os.path.basename(path))[0]
        n = 0
        for lineno, (_, line) in enumerate(iter_lines(path), start=1):
            if not line.strip():
                continue
            rec, text = parse_record(line, path, lineno, "text")
            task = rec.get("task", default)
            index.add(str(task), text)
            n += 1
        if n == 0:
            raise InputError(f"{path}: empty input (no task records)")
    if not len(index):
        raise InputError(f"no task n-grams: every task text has fewer than --min-ngram={min_ngram} words")
    index.build()
    return index


# ----------------------------------------------------------------------------------------------------------
# The two passes (run inline or in worker processes)

_G: dict = {}


def _init_worker(index: TaskNgrams, cfg: DecontamConfig, active: np.ndarray | None) -> None:
    _G["index"], _G["cfg"], _G["active"] = index, cfg, active


def count_chunk(args: tuple[int, list[bytes]]) -> tuple[Counter, list[int], int, int]:
    """Pass 1 on a chunk of lines: document frequency of each n-gram, line numbers of documents with any hit."""
    first_lineno, lines = args
    index: TaskNgrams = _G["index"]
    cfg: DecontamConfig = _G["cfg"]
    counts: Counter = Counter()
    hit_lines: list[int] = []
    nbytes = docs = 0
    for k, line in enumerate(lines):
        nbytes += len(line)
        if not line.strip():
            continue
        docs += 1
        _, text = parse_record(line, cfg.input, first_lineno + k, cfg.text_key)
        found = {gid for _, gid in index.hits(words_of(text))}
        if found:
            counts.update(found)
            hit_lines.append(first_lineno + k)
    return counts, hit_lines, nbytes, docs


def clean_chunk(args: tuple[int, int, list[bytes], list[int]]) -> tuple[bytes, Counter, list[dict], int]:
    """Pass 2 on a chunk: output lines, outcome counts, per-document hit records."""
    first_lineno, first_doc, lines, hit_lines = args
    index: TaskNgrams = _G["index"]
    cfg: DecontamConfig = _G["cfg"]
    active = _G["active"]
    prefix = "-".join(index.task_names)
    hit_set = set(hit_lines)
    out: list[bytes] = []
    outcome: Counter = Counter()
    hits: list[dict] = []
    doc = first_doc
    for k, line in enumerate(lines):
        if not line.strip():
            continue
        doc += 1
        lineno = first_lineno + k
        rec = json.loads(line)
        text = rec[cfg.text_key]
        if lineno in hit_set:
            pieces, matched = clean_text(text, index, active, cfg.window, cfg.min_piece)
        else:
            pieces, matched = [text], []
        if not matched:
            outcome["clean"] += 1
        elif len(pieces) > cfg.max_splits:
            outcome["dropped_too_many_splits"] += 1
        elif not pieces:
            outcome["dropped_no_piece_left"] += 1
        elif len(pieces) == 1:
            outcome["trimmed"] += 1
        else:
            outcome["split"] += 1
        if matched:
            hits.append({"line": lineno, "id": rec.get(cfg.id_key), "ngrams": sorted(set(matched))})
            outcome["matches"] += len(matched)
        if len(pieces) > cfg.max_splits:
            pieces = []
        old = rec.get("split_id")
        use_prefix = f"{old}-" if old is not None else ""
        for i, piece in enumerate(pieces):
            rec[cfg.text_key] = piece
            rec["split_id"] = f"{use_prefix}{prefix}-{doc:010d}-{i:04d}"
            out.append(json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n")
        outcome["pieces_out"] += len(pieces)
        outcome["chars_removed"] += len(text) - sum(len(p) for p in pieces)
    return b"".join(out), outcome, hits, doc - first_doc


def _chunks(path: str, chunk_lines: int):
    """Yield ``(first line number, [raw lines])``."""
    buf: list[bytes] = []
    first = 1
    for lineno, (_, line) in enumerate(iter_lines(path), start=1):
        if not buf:
            first = lineno
        buf.append(line)
        if len(buf) >= chunk_lines:
            yield first, buf
            buf = []
    if buf:
        yield first, buf


def _map(fn, tasks, workers: int, initargs: tuple):
    """Ordered map, inline for one worker, else a process pool."""
    if workers <= 1:
        _init_worker(*initargs)
        for t in tasks:
            yield fn(t)
        return
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        yield from pool.imap(fn, tasks, chunksize=1)


def run_decontaminate(cfg: DecontamConfig) -> dict:
    from tqdm.auto import tqdm

    check_input_files([cfg.input])
    real = os.path.realpath
    if real(cfg.output) in {real(cfg.input), *map(real, cfg.tasks)}:
        raise InputError(f"--output {cfg.output} would overwrite an input file")
    if real(cfg.report_path()) in {real(cfg.input), real(cfg.output), *map(real, cfg.tasks)}:
        raise InputError(f"report path {cfg.report_path()} collides with an input or the output")
    t0 = time.perf_counter()
    index = load_tasks(cfg.tasks, cfg.max_ngram, cfg.min_ngram)
    t_tasks = time.perf_counter() - t0
    size = os.path.getsize(cfg.input)

    # pass 1: document frequency of every task n-gram
    t1 = time.perf_counter()
    counts: Counter = Counter()
    hit_lines: list[int] = []
    docs = 0
    bar = tqdm(total=size, unit="B", unit_scale=True, desc="count n-grams", disable=not cfg.progress, leave=False)
    try:
        for c, h, nb, nd in _map(count_chunk, _chunks(cfg.input, cfg.chunk_lines), cfg.workers, (index, cfg, None)):
            counts.update(c)
            hit_lines += h
            docs += nd
            bar.update(nb)
    finally:
        bar.close()
    if docs == 0:
        raise InputError(f"{cfg.input}: empty input (no records)")
    freq = np.zeros(len(index), dtype=np.int64)
    for gid, c in counts.items():
        freq[gid] = c
    active = freq < cfg.frequent_threshold
    t_count = time.perf_counter() - t1

    # pass 2: cut the remaining n-grams out
    t2 = time.perf_counter()
    hit_iter = iter(sorted(hit_lines))
    pending = next(hit_iter, None)

    def tasks_for_pass2():
        nonlocal pending
        doc = 0
        for first, lines in _chunks(cfg.input, cfg.chunk_lines):
            last = first + len(lines) - 1
            mine = []
            while pending is not None and pending <= last:
                mine.append(pending)
                pending = next(hit_iter, None)
            yield first, doc, lines, mine
            doc += sum(1 for ln in lines if ln.strip())

    outcome: Counter = Counter()
    hit_docs: list[dict] = []
    per_task_docs: Counter = Counter()
    per_task_matches: Counter = Counter()
    n_hit_docs = 0
    bar = tqdm(total=docs, unit="doc", desc="decontaminate", disable=not cfg.progress, leave=False)
    try:
        with atomic_write(cfg.output, fsync=True) as out:
            for data, oc, hits, nd in _map(clean_chunk, tasks_for_pass2(), cfg.workers, (index, cfg, active)):
                out.write(data)
                outcome.update(oc)
                for h in hits:
                    n_hit_docs += 1
                    tasks_hit = set()
                    for gid in h["ngrams"]:
                        for t in index.tasks_of(gid):
                            per_task_matches[t] += 1
                            tasks_hit.add(t)
                    per_task_docs.update(tasks_hit)
                    if len(hit_docs) < _HIT_LIST_LIMIT:
                        hit_docs.append(
                            {
                                "line": h["line"],
                                "id": h["id"],
                                "ngrams": [
                                    {"ngram": index.ngram_text(g), "tasks": index.tasks_of(g)} for g in h["ngrams"]
                                ],
                            }
                        )
                bar.update(nd)
            t_clean = time.perf_counter() - t2
            by_len = Counter(len(g) for g in index.ngrams)
            frequent = np.flatnonzero(~active)
            top = frequent[np.argsort(-freq[frequent], kind="stable")][:20]
            scan_s = t_count + t_clean
            report = {
                "tool": "mtnlg-decontaminate",
                "settings": {
                    "input": cfg.input,
                    "output": cfg.output,
                    "tasks": cfg.tasks,
                    "text_key": cfg.text_key,
                    "max_ngram": cfg.max_ngram,
                    "min_ngram": cfg.min_ngram,
                    "window": cfg.window,
                    "min_piece": cfg.min_piece,
                    "max_splits": cfg.max_splits,
                    "frequent_threshold": cfg.frequent_threshold,
                    "workers": cfg.workers,
                },
                "tasks": {
                    "task_texts": dict(index.task_texts),
                    "ngrams": len(index),
                    "ngrams_by_length": {str(k): v for k, v in sorted(by_len.items())},
                },
                "frequent_ngrams": {
                    "ignored": int(len(frequent)),
                    "top": [
                        {"ngram": index.ngram_text(int(g)), "documents": int(freq[g]), "tasks": index.tasks_of(int(g))}
                        for g in top
                    ],
                },
                "documents": {
                    "in": docs,
                    "records_out": outcome["pieces_out"],
                    "clean": outcome["clean"],
                    "trimmed": outcome["trimmed"],
                    "split": outcome["split"],
                    "dropped_too_many_splits": outcome["dropped_too_many_splits"],
                    "dropped_no_piece_left": outcome["dropped_no_piece_left"],
                    "matches_removed": outcome["matches"],
                    "chars_removed": outcome["chars_removed"],
                },
                "hits": {
                    "documents": n_hit_docs,
                    "per_task": {
                        t: {"documents": per_task_docs[t], "matches": per_task_matches[t]} for t in index.task_names
                    },
                    "list": hit_docs,
                    "list_truncated": n_hit_docs > len(hit_docs),
                },
                "bytes_in": size,
                "timings_s": {
                    "load_tasks": round(t_tasks, 3),
                    "count_pass": round(t_count, 3),
                    "clean_pass": round(t_clean, 3),
                },
                "mb_per_s": round(size / 1e6 / scan_s, 2) if scan_s > 0 else None,
                "mb_per_s_per_worker": round(size / 1e6 / scan_s / max(1, cfg.workers), 2) if scan_s > 0 else None,
            }
            # the output appears (os.replace on leaving this block) before the report; drop any stale report first
            if os.path.exists(cfg.report_path()):
                os.unlink(cfg.report_path())
    finally:
        bar.close()
    write_json_atomic(cfg.report_path(), report, fsync=True)
    return report


def format_summary(report: dict) -> str:
    d = report["documents"]
    s = report["settings"]
    t = report["tasks"]
    lines = [
        "mtnlg-decontaminate summary",
        f"  tasks      {sum(t['task_texts'].values())} texts from {len(t['task_texts'])} tasks -> {t['ngrams']} n-grams"
        f" (by length {t['ngrams_by_length']})",
        f"  frequent   {report['frequent_ngrams']['ignored']} n-grams in >= {s['frequent_threshold']}"
        " documents ignored",
        f"  documents  {d['in']} in -> {d['records_out']} records out: {d['clean']} clean, {d['trimmed']} trimmed,"
        f" {d['split']} split, {d['dropped_too_many_splits']} dropped (> {s['max_splits']} pieces),"
        f" {d['dropped_no_piece_left']} dropped (no piece > {s['min_piece']} chars)",
        f"  removed    {d['matches_removed']} matches, {d['chars_removed']} chars",
    ]
    per = report["hits"]["per_task"]
    if per:
        lines.append("  per task   " + ", ".join(f"{k}: {v['documents']} docs" for k, v in per.items()))
    tm = report["timings_s"]
    lines.append(
        f"  time       tasks {tm['load_tasks']:.2f}s  count {tm['count_pass']:.2f}s  clean {tm['clean_pass']:.2f}s"
        f"  -> {report['mb_per_s']} MB/s ({report['mb_per_s_per_worker']} MB/s per worker)"
    )
    return "\n".join(lines)
