"""Stage 1 of dedup: MinHash signature shards, and loading them back as one :class:`Corpus`.

A shard is a byte range of one input file (aligned to line starts); its ``.npz`` holds, per record, the byte
offset and length of the line, the line number within the shard, the shingle count, the 128-bit exact-duplicate
key of the normalised text and the uint32 MinHash signature (``num_perm * 4`` bytes/doc).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .jsonl import InputError, atomic_write, count_lines_before, iter_lines, parse_record
from .minhash import MinHasher
from .shingles import ShingleSpec, combine, exact_key, tokens

_MASK32 = np.uint64(0xFFFFFFFF)


def shard_name(fi: int, si: int) -> str:
    return f"f{fi:04d}-s{si:05d}.npz"


def compute_shard(args: tuple) -> dict:
    """Read one byte range of one input file and write its signature shard. Runs in worker processes."""
    path, start, end, out_file, text_key, spec_str, num_perm, seed, scheme = args
    spec = ShingleSpec.parse(spec_str)
    hasher = MinHasher(num_perm, seed, scheme)
    offsets, lengths, lines, nsh, ex_hi, ex_lo, sigs = [], [], [], [], [], [], []
    seen: dict[tuple[int, int], int] = {}
    nbytes = 0
    local = 0
    for off, line in iter_lines(path, start, end):
        local += 1
        nbytes += len(line)
        if not line.strip():
            continue
        try:
            _, text = parse_record(line, path, local, text_key)
        except InputError:
            lineno = count_lines_before(path, start) + local
            parse_record(line, path, lineno, text_key)  # re-raise with the file's line number
            raise
        norm, units = tokens(text, spec)
        key = exact_key(norm)
        prev = seen.get(key)
        if prev is None:
            sh = combine(units, spec.n)
            sig = hasher.signature((sh & _MASK32).astype(np.uint32))
            seen[key] = len(sigs)
            count = len(sh)
        else:  # same normalised text as an earlier doc of this shard: same shingles, same signature
            sig, count = sigs[prev], nsh[prev]
        offsets.append(off)
        lengths.append(len(line))
        lines.append(local)
        nsh.append(count)
        ex_hi.append(key[0])
        ex_lo.append(key[1])
        sigs.append(sig)
    arrays = {
        "offsets": np.asarray(offsets, dtype=np.uint64),
        "lengths": np.asarray(lengths, dtype=np.uint32),
        "lines": np.asarray(lines, dtype=np.uint32),
        "nsh": np.asarray(nsh, dtype=np.uint32),
        "ex_hi": np.asarray(ex_hi, dtype=np.uint64),
        "ex_lo": np.asarray(ex_lo, dtype=np.uint64),
        "sigs": np.stack(sigs) if sigs else np.empty((0, num_perm), dtype=np.uint32),
        "n_lines": np.asarray([local], dtype=np.int64),
    }
    with atomic_write(out_file) as f:
        np.savez(f, **arrays)
    return {"docs": len(offsets), "bytes": nbytes}


@dataclass
class Corpus:
    """Everything the later stages need about the documents, in global order (file order, then line)."""

    file_idx: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    lines: np.ndarray
    nsh: np.ndarray
    ex_hi: np.ndarray
    ex_lo: np.ndarray
    sigs: np.ndarray
    rank: np.ndarray  # priority rank: lower is kept
    exact_rep: np.ndarray  # best-ranked document with the same normalised text

    def __len__(self) -> int:
        return len(self.offsets)


def load_corpus(sig_dir: str, plan: list, n_files: int, file_rank: list[int]) -> Corpus:
    parts: dict[str, list] = {
        k: [] for k in ("file_idx", "offsets", "lengths", "lines", "nsh", "ex_hi", "ex_lo", "sigs")
    }
    line_base = [0] * n_files
    for fi, si, _, _ in plan:
        with np.load(os.path.join(sig_dir, shard_name(fi, si))) as z:
            n = len(z["offsets"])
            parts["file_idx"].append(np.full(n, fi, dtype=np.int32))
            for k in ("offsets", "lengths", "nsh", "ex_hi", "ex_lo", "sigs"):
                parts[k].append(z[k])
            parts["lines"].append(z["lines"].astype(np.int64) + line_base[fi])
            line_base[fi] += int(z["n_lines"][0])
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
    return Corpus(rank=rank, exact_rep=exact_rep, **arr)
