"""Dedup's per-shard data: MinHash signature shards, the document table, random access to signatures.

A shard is a byte range of one input file (aligned to line starts). Its task writes ``<shard>.sig.npy`` (uint32
MinHash signatures, ``num_perm * 4`` bytes/doc, memory-mapped by later stages), ``<shard>.keys.npy`` when a
banding is given (the 64-bit LSH key of every document for every band, ``(bands, docs)``, so that a bucket task
reads one contiguous row per shard instead of its band's columns of every signature) and then ``<shard>.npz``
(per record: byte offset and length of the line, line number within the shard, shingle count, 128-bit
exact-duplicate key of the normalised text); the ``.npz`` appearing last marks the shard finished.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from mtnlg_lightning.corpora.jsonl import ShardRecords, atomic_write
from mtnlg_lightning.corpora.mapcache import load_map
from mtnlg_lightning.corpora.records import BAD_REASONS
from mtnlg_lightning.curation.lsh import Banding, band_key
from mtnlg_lightning.curation.minhash import MinHasher
from mtnlg_lightning.curation.shingles import ShingleSpec, combine, exact_key, tokens

_MASK32 = np.uint64(0xFFFFFFFF)


@dataclass(frozen=True)
class SignatureSettings:
    text_key: str
    shingle: str
    num_perm: int
    seed: int
    scheme: str
    on_bad_record: str = "error"  # "error": stop at the first bad record; "skip": count it by reason


@dataclass(frozen=True)
class Shard:
    file_idx: int
    shard_idx: int
    path: str
    start: int
    end: int
    label: str = ""  # the input as the user named it, for messages (``path`` may be a decompressed copy)
    kind: str = "jsonl"  # the input's kind: line numbers are rows of a parquet file, items of a JSON array

    @property
    def name(self) -> str:
        return f"f{self.file_idx:04d}-s{self.shard_idx:05d}"


def shard_meta_path(sig_dir: str, shard: Shard) -> str:
    return os.path.join(sig_dir, shard.name + ".npz")


def shard_sig_path(sig_dir: str, shard: Shard) -> str:
    return os.path.join(sig_dir, shard.name + ".sig.npy")


def shard_keys_path(sig_dir: str, shard: Shard) -> str:
    return os.path.join(sig_dir, shard.name + ".keys.npy")


def compute_shard(settings: SignatureSettings, job: tuple[Shard, str], banding: Banding | None = None) -> int:
    """Read one shard and write its signature files, and its LSH band keys if ``banding`` is given (skipped if
    already written). Returns its byte size."""
    shard, sig_dir = job
    meta_path = shard_meta_path(sig_dir, shard)
    if os.path.exists(meta_path):
        return shard.end - shard.start
    spec = ShingleSpec.parse(settings.shingle)
    hasher = MinHasher(settings.num_perm, settings.seed, settings.scheme)
    offsets, lengths, lines, ex_hi, ex_lo, source = [], [], [], [], [], []
    shingles: list[np.ndarray] = []  # 32-bit shingle hashes of each distinct normalised text of the shard
    seen: dict[tuple[int, int], int] = {}
    records = ShardRecords(shard, settings.text_key, settings.on_bad_record)
    for off, line, local, text in records:
        norm, units = tokens(text, spec)
        key = exact_key(norm)
        k = seen.get(key)
        if k is None:  # same normalised text as an earlier doc of this shard: same shingles, same signature
            k = seen[key] = len(shingles)
            shingles.append((combine(units, spec.n) & _MASK32).astype(np.uint32))
        offsets.append(off)
        lengths.append(len(line))
        lines.append(local)
        ex_hi.append(key[0])
        ex_lo.append(key[1])
        source.append(k)
    source_idx = np.asarray(source, dtype=np.int64)
    sigs = hasher.signatures(shingles)[source_idx] if shingles else np.empty((0, settings.num_perm), np.uint32)
    nsh = np.fromiter(map(len, shingles), dtype=np.uint32, count=len(shingles))[source_idx]
    with atomic_write(shard_sig_path(sig_dir, shard)) as f:
        np.save(f, sigs)
    if banding is not None:
        r = banding.rows
        keys = np.empty((banding.bands, len(sigs)), dtype=np.uint64)
        for j in range(banding.bands):
            keys[j] = band_key(sigs[:, j * r : (j + 1) * r], j)
        with atomic_write(shard_keys_path(sig_dir, shard)) as f:
            np.save(f, keys)
    with atomic_write(meta_path) as f:
        np.savez(
            f,
            offsets=np.asarray(offsets, dtype=np.uint64),
            lengths=np.asarray(lengths, dtype=np.uint32),
            lines=np.asarray(lines, dtype=np.uint32),
            nsh=nsh.astype(np.uint32),
            ex_hi=np.asarray(ex_hi, dtype=np.uint64),
            ex_lo=np.asarray(ex_lo, dtype=np.uint64),
            n_lines=np.asarray([records.lines], dtype=np.int64),
            bad=np.asarray([records.bad[r] for r in BAD_REASONS], dtype=np.int64),
        )
    return shard.end - shard.start


@dataclass
class DocTable:
    """Per-document facts the later stages need, in global order (file order, then line); no signatures."""

    file_idx: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    lines: np.ndarray
    nsh: np.ndarray
    rank: np.ndarray  # priority rank: lower is kept
    exact_rep: np.ndarray  # best-ranked document with the same normalised text
    shard_starts: np.ndarray  # first document of every shard, plus the total

    def __len__(self) -> int:
        return len(self.offsets)

    def save(self, directory: str) -> None:
        """One ``.npy`` per column, so that tasks memory-map only the columns they read."""
        for k, v in self.__dict__.items():
            with atomic_write(os.path.join(directory, k + ".npy")) as f:
                np.save(f, v)

    @classmethod
    def load(cls, directory: str) -> DocTable:
        return cls(**{k: load_map(os.path.join(directory, k + ".npy")) for k in cls.__annotations__})

    def lsh_members(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Documents in ``[lo, hi)`` that go through LSH: exact-duplicate representatives with at least one
        shingle (a range reads only its part of the two columns)."""
        hi = len(self) if hi is None else hi
        ids = np.arange(lo, hi, dtype=np.int64)
        return ids[(self.exact_rep[lo:hi] == ids) & (self.nsh[lo:hi] > 0)]


def build_doc_table(sig_dir: str, shards: list[Shard], n_files: int, file_rank: list[int]) -> DocTable:
    parts: dict[str, list] = {k: [] for k in ("file_idx", "offsets", "lengths", "lines", "nsh", "ex_hi", "ex_lo")}
    line_base = [0] * n_files
    counts = []
    for shard in shards:
        with np.load(shard_meta_path(sig_dir, shard)) as z:
            n = len(z["offsets"])
            counts.append(n)
            parts["file_idx"].append(np.full(n, shard.file_idx, dtype=np.int32))
            for k in ("offsets", "lengths", "nsh", "ex_hi", "ex_lo"):
                parts[k].append(z[k])
            parts["lines"].append(z["lines"].astype(np.int64) + line_base[shard.file_idx])
            line_base[shard.file_idx] += int(z["n_lines"][0])
    arr = {k: np.concatenate(v) for k, v in parts.items()}
    n = len(arr["offsets"])
    # priority rank: input priority first, then global order (ties by first occurrence)
    frank = np.asarray(file_rank, dtype=np.int64)[arr["file_idx"]]
    order = np.lexsort((np.arange(n), frank))
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    # exact duplicate groups: same 128-bit key of the normalised text; representative = best rank
    exact_rep = np.arange(n, dtype=np.int64)
    if n:
        o = np.lexsort((rank, arr["ex_lo"], arr["ex_hi"]))
        hi, lo = arr["ex_hi"][o], arr["ex_lo"][o]
        new_group = np.ones(n, dtype=bool)
        new_group[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
        first = np.flatnonzero(new_group)
        group_of = np.cumsum(new_group) - 1
        exact_rep[o] = o[first[group_of]]
    shard_starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    del arr["ex_hi"], arr["ex_lo"]
    return DocTable(rank=rank, exact_rep=exact_rep, shard_starts=shard_starts, **arr)


class SignatureReader:
    """Signatures of any documents, read from the memory-mapped shard files (nothing loaded up front)."""

    def __init__(self, sig_dir: str, shards: list[Shard], shard_starts: np.ndarray):
        self.starts = shard_starts
        self.paths = [shard_sig_path(sig_dir, s) for s in shards]
        self._maps: dict[int, np.ndarray] = {}

    def map(self, s: int) -> np.ndarray:
        m = self._maps.get(s)
        if m is None:
            m = self._maps[s] = load_map(self.paths[s])
        return m

    def rows(self, docs: np.ndarray) -> np.ndarray:
        docs = np.asarray(docs, dtype=np.int64)
        if not self.paths:
            return np.empty((0, 0), dtype=np.uint32)
        shard = np.searchsorted(self.starts, docs, side="right") - 1
        out = None
        for s in np.unique(shard).tolist():
            m = shard == s
            rows = self.map(s)[docs[m] - self.starts[s]]
            if out is None:
                out = np.empty((len(docs), rows.shape[1]), dtype=np.uint32)
            out[m] = rows
        return out if out is not None else np.empty((0, self.map(0).shape[1]), dtype=np.uint32)


def estimated_jaccard_pairs(reader: SignatureReader, pairs: np.ndarray, step: int = 65536) -> np.ndarray:
    """MinHash estimate (fraction of equal signature entries) of every pair, in bounded memory."""
    if not len(pairs):
        return np.empty(0)
    return np.concatenate(
        [
            (reader.rows(pairs[s : s + step, 0]) == reader.rows(pairs[s : s + step, 1])).mean(axis=1)
            for s in range(0, len(pairs), step)
        ]
    )
