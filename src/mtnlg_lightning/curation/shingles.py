"""Text normalisation and vectorised shingle hashing.

Normalisation (used for shingling *and* for the exact-duplicate hash):
  lowercase, ASCII punctuation -> space, split on whitespace.  ``word:K`` shingles are the K-word windows of
  that word list; ``char:N`` shingles are the N-character windows of the lowercased, whitespace-collapsed text.
  A document shorter than one shingle has a single shingle (the whole token sequence); an empty document has none.

Hashing: every word (or character) is hashed once (xxh3-64), then K consecutive hashes are combined with
multiply-add arithmetic in uint64 (wrap-around) and finalised with the MurmurHash3 64-bit mixer, giving one
64-bit hash per shingle.  Exact Jaccard is computed on sets of these 64-bit hashes (a false collision between
two different shingles has probability ~2^-64); MinHash consumes their lower 32 bits.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np
import xxhash

_PUNCT_TO_SPACE = str.maketrans({c: " " for c in string.punctuation})
_COMBINE_MULT = np.uint64(0x9E3779B97F4A7C15)
_CHAR_MULT = np.uint64(0xD6E8FEB86659FD93)
_CHAR_ADD = np.uint64(0x2545F4914F6CDD1D)
_X = xxhash.xxh3_64_intdigest


@dataclass(frozen=True)
class ShingleSpec:
    kind: str = "word"  # "word" or "char"
    n: int = 5

    @classmethod
    def parse(cls, spec: str) -> ShingleSpec:
        try:
            kind, n_str = spec.split(":")
            n = int(n_str)
        except ValueError:
            raise ValueError(f"shingle spec must look like word:5 or char:9, got {spec!r}") from None
        if kind not in ("word", "char") or n < 1:
            raise ValueError(f"shingle spec must look like word:5 or char:9, got {spec!r}")
        return cls(kind, n)

    def __str__(self) -> str:
        return f"{self.kind}:{self.n}"


def normalize_words(text: str) -> list[str]:
    """Lowercase, ASCII punctuation to spaces, split on whitespace."""
    return text.lower().translate(_PUNCT_TO_SPACE).split()


def normalize_chars(text: str) -> str:
    """Lowercase and collapse whitespace runs to one space (the unit for ``char:N`` shingles)."""
    return " ".join(text.lower().split())


# MurmurHash3's finaliser for each word size: shift, multiplier, shift, multiplier, shift
_FMIX = {
    np.dtype(np.uint32): tuple(np.uint32(c) for c in (16, 0x85EBCA6B, 13, 0xC2B2AE35, 16)),
    np.dtype(np.uint64): tuple(np.uint64(c) for c in (33, 0xFF51AFD7ED558CCD, 33, 0xC4CEB9FE1A85EC53, 33)),
}


def fmix(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's finaliser (a bijection), element-wise on a uint32 or uint64 array: its 32- or 64-bit form."""
    s1, m1, s2, m2, s3 = _FMIX[h.dtype]
    h = h ^ (h >> s1)
    h = h * m1
    h = h ^ (h >> s2)
    h = h * m2
    return h ^ (h >> s3)


def word_hashes(words: list[str]) -> np.ndarray:
    """xxh3-64 of each word's UTF-8 bytes, as uint64."""
    return np.fromiter(map(_X, map(str.encode, words)), dtype=np.uint64, count=len(words))


def char_hashes(norm: str) -> np.ndarray:
    cps = np.frombuffer(norm.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    return fmix(cps * _CHAR_MULT + _CHAR_ADD)


def combine(unit_hashes: np.ndarray, n: int) -> np.ndarray:
    """Hash every window of ``n`` consecutive unit hashes (fewer units than ``n``: one window of all)."""
    m = len(unit_hashes)
    if m == 0:
        return np.empty(0, dtype=np.uint64)
    n = min(n, m)
    length = m - n + 1
    out = unit_hashes[:length].copy()
    for j in range(1, n):
        out *= _COMBINE_MULT
        out += unit_hashes[j : j + length]
    return fmix(out)


def tokens(text: str, spec: ShingleSpec) -> tuple[str, np.ndarray]:
    """Return ``(normalised text, unit hashes)`` for a document."""
    if spec.kind == "word":
        words = normalize_words(text)
        return " ".join(words), word_hashes(words)
    norm = normalize_chars(text)
    return norm, char_hashes(norm)


def shingle_hashes(text: str, spec: ShingleSpec) -> np.ndarray:
    """64-bit hashes of all shingles of ``text`` (with repeats, in order)."""
    _, units = tokens(text, spec)
    return combine(units, spec.n)


def shingle_set(text: str, spec: ShingleSpec) -> np.ndarray:
    """Sorted unique 64-bit shingle hashes: the set used for exact Jaccard."""
    h = np.sort(shingle_hashes(text, spec))  # sort + neighbour test: ~2x faster than np.unique's hash table
    return h[np.concatenate(([True], h[1:] != h[:-1]))] if len(h) else h


def exact_key(norm: str) -> tuple[int, int]:
    """128-bit hash of the normalised text, as two uint64 halves (exact-duplicate key)."""
    d = xxhash.xxh3_128_intdigest(norm.encode("utf-8"))
    return d >> 64, d & 0xFFFFFFFFFFFFFFFF


def jaccard_sorted(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard of two sorted unique uint64 arrays."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    if len(a) == 0 or len(b) == 0:
        return 0.0
    if len(a) > len(b):
        a, b = b, a
    idx = np.searchsorted(b, a)
    idx[idx == len(b)] = len(b) - 1
    inter = int(np.count_nonzero(b[idx] == a))
    return inter / (len(a) + len(b) - inter)


# ----------------------------------------------------------------------------------------------------------
# Reference (string) shingling: slow, used for ground truth and tests.


def shingle_strings(text: str, spec: ShingleSpec) -> set[str]:
    if spec.kind == "word":
        words = normalize_words(text)
        if not words:
            return set()
        n = min(spec.n, len(words))
        return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}
    norm = normalize_chars(text)
    if not norm:
        return set()
    n = min(spec.n, len(norm))
    return {norm[i : i + n] for i in range(len(norm) - n + 1)}


def jaccard_strings(a: set[str], b: set[str]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)
