"""The reference paths the curation tests compare against: datasketch's own MinHash and MinHashLSH (slow, one
document at a time), fed one shingle string at a time. The package computes the same answers vectorised
(`curation/shingles.py`, `curation/minhash.py`, `curation/lsh.py`) and never imports this module."""

from __future__ import annotations

import numpy as np
from datasketch import LeanMinHash, MinHash, MinHashLSH

from mtnlg_lightning.curation.lsh import Banding
from mtnlg_lightning.curation.minhash import MinHasher
from mtnlg_lightning.curation.shingles import ShingleSpec, char_hashes, combine, word_hashes


def shingle_string_hash(shingle: str, spec: ShingleSpec) -> int:
    """64-bit hash of one shingle given as a string (the same value `shingle_hashes` produces).

    Only valid for full-length shingles (or a whole short document): lets a datasketch ``MinHash`` fed with
    shingle strings (``hashfunc=lambda s: shingle_string_hash(s, spec) & 0xFFFFFFFF``) reproduce our signatures.
    """
    if spec.kind == "word":
        units = word_hashes(shingle.split(" "))
    else:
        units = char_hashes(shingle)
    return int(combine(units, len(units))[0])


def datasketch_minhash(hasher: MinHasher, hashes32) -> MinHash:
    """datasketch's own ``MinHash.update_batch`` over the same 32-bit hashes, with the hasher's seed and scheme."""
    m = MinHash(num_perm=hasher.num_perm, seed=hasher.seed, scheme=hasher.scheme, hashfunc=int)
    m.update_batch([int(h) for h in hashes32])
    return m


def to_lean(hasher: MinHasher, sig: np.ndarray) -> LeanMinHash:
    """A signature as a ``datasketch.LeanMinHash`` (datasketch's storage dtype: uint32 affine32, uint64 legacy)."""
    hashvalues = np.asarray(sig, dtype=np.uint32 if hasher.scheme == "affine32" else np.uint64)
    return LeanMinHash(seed=hasher.seed, hashvalues=hashvalues, scheme=hasher.scheme)


def datasketch_candidate_pairs(leans, banding: Banding) -> set[tuple[int, int]]:
    """Candidate pairs from ``datasketch.MinHashLSH(params=(b, r))`` filled through an ``insertion_session``."""
    lsh = MinHashLSH(num_perm=banding.num_perm, params=(banding.bands, banding.rows))
    with lsh.insertion_session() as session:
        for i, m in enumerate(leans):
            session.insert(i, m)
    pairs = set()
    for i, m in enumerate(leans):
        for k in lsh.query(m):
            if k != i:
                pairs.add((min(i, k), max(i, k)))
    return pairs
