"""Explicit banding: the S-curve formula, bucket pairing, equality with datasketch's MinHashLSH."""

import numpy as np
import pytest
from datasketch_reference import datasketch_candidate_pairs, to_lean

from mtnlg_lightning.curation.lsh import (
    DEFAULT_BANDING,
    MTNLG_BANDING,
    Banding,
    band_keys,
    band_pairs,
    candidate_pairs,
    candidate_probability,
)
from mtnlg_lightning.curation.minhash import MinHasher


def test_candidate_probability_formula():
    assert candidate_probability(0.8, 20, 13) == pytest.approx(1 - (1 - 0.8**13) ** 20)
    # the paper's 20 x 13 misses many pairs near the threshold (the reason for the default)
    assert MTNLG_BANDING.num_perm == 260
    assert candidate_probability(0.8, 20, 13) == pytest.approx(0.677, abs=0.002)
    assert candidate_probability(0.85, 20, 13) == pytest.approx(0.924, abs=0.002)
    # the default meets recall >= 0.95 at J >= 0.85 and >= 0.90 on [0.80, 0.85) by construction
    assert DEFAULT_BANDING.num_perm * 4 <= 1100
    assert candidate_probability(0.80, DEFAULT_BANDING.bands, DEFAULT_BANDING.rows) >= 0.99
    assert candidate_probability(0.85, DEFAULT_BANDING.bands, DEFAULT_BANDING.rows) >= 0.999
    assert set(DEFAULT_BANDING.probabilities()) == {"0.70", "0.80", "0.85", "0.90"}


def _sets_with_jaccard(j: float, union: int = 600, seed: int = 0):
    """Two sets of 32-bit values with exact Jaccard j (|A and B| / |A or B|)."""
    rng = np.random.default_rng(seed)
    vals = rng.choice(2**32, size=union, replace=False).astype(np.uint32)
    inter = int(round(j * union))
    rest = union - inter
    a = np.concatenate([vals[:inter], vals[inter : inter + rest // 2]])
    b = np.concatenate([vals[:inter], vals[inter + rest // 2 :]])
    return a, b


@pytest.mark.parametrize("j", [0.6, 0.8])
def test_empirical_candidate_rate_follows_the_s_curve(j):
    banding = Banding(8, 4)  # steep enough to test with few trials
    a, b = _sets_with_jaccard(j)
    trials = 300
    hits = 0
    for seed in range(trials):
        mh = MinHasher(banding.num_perm, seed=seed + 1)
        sigs = np.stack([mh.signature(a), mh.signature(b)])
        hits += len(candidate_pairs(sigs, np.arange(2), banding)) == 1
    p = candidate_probability(j, banding.bands, banding.rows)
    sd = (p * (1 - p) / trials) ** 0.5
    assert abs(hits / trials - p) < 4 * sd + 1e-9


def test_band_pairs_all_pairs_in_small_buckets_and_capped_in_large_ones():
    keys = np.array([5, 7, 5, 5, 9, 7], dtype=np.uint64)
    members = np.arange(6)
    pairs = {tuple(p) for p in band_pairs(keys, members).tolist()}
    assert pairs == {(0, 2), (0, 3), (2, 3), (1, 5)}
    # a bucket of 10 with at most 2 neighbours: each member paired with the next two (still connected)
    big = band_pairs(np.zeros(10, dtype=np.uint64), np.arange(10), max_neighbors=2)
    assert {tuple(p) for p in big.tolist()} == {(i, i + d) for i in range(10) for d in (1, 2) if i + d < 10}


def test_band_keys_depend_on_band_values_only():
    sigs = np.array([[1, 2, 3, 4], [1, 2, 9, 9], [0, 2, 3, 4]], dtype=np.uint32)
    k = band_keys(sigs, Banding(2, 2))
    assert k[0, 0] == k[1, 0] and k[0, 0] != k[2, 0]
    assert k[0, 1] == k[2, 1] and k[0, 1] != k[1, 1]


def test_candidates_equal_datasketch_minhashlsh_with_same_params():
    rng = np.random.default_rng(1)
    banding = Banding(6, 3)
    mh = MinHasher(banding.num_perm, seed=3)
    base = [rng.choice(2**32, size=200, replace=False).astype(np.uint32) for _ in range(20)]
    docs = []
    for s in base:  # each base plus a perturbed copy: plenty of candidates, plenty of non-candidates
        docs.append(s)
        t = s.copy()
        t[: int(rng.integers(10, 120))] = rng.integers(0, 2**32, size=1, dtype=np.uint32)
        docs.append(t)
    sigs = np.stack([mh.signature(d) for d in docs])
    ours = {tuple(p) for p in candidate_pairs(sigs, np.arange(len(docs)), banding).tolist()}
    ref = datasketch_candidate_pairs([to_lean(mh, s) for s in sigs], banding)
    assert ours == ref and len(ref) > 5
