"""Exact-Jaccard verification of LSH candidate pairs (dedup's verify stage).

Candidate documents are re-read by byte offset and re-shingled (LRU cache), so nothing but signatures has to
be kept per document between stages.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np

from mtnlg_lightning.curation.shingles import ShingleSpec, jaccard_sorted, shingle_set
from mtnlg_lightning.curation.unionfind import UnionFind


class DocStore:
    def __init__(self, paths, file_idx, offsets, lengths, text_key, spec_str, capacity: int = 20000):
        self.paths, self.file_idx, self.offsets, self.lengths = paths, file_idx, offsets, lengths
        self.text_key, self.spec = text_key, ShingleSpec.parse(spec_str)
        self.capacity = capacity
        self.cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self.handles: dict[int, object] = {}

    def raw(self, doc: int) -> bytes:
        fi = int(self.file_idx[doc])
        f = self.handles.get(fi)
        if f is None:
            f = self.handles[fi] = open(self.paths[fi], "rb")  # noqa: SIM115 - closed in close()
        f.seek(int(self.offsets[doc]))
        return f.read(int(self.lengths[doc]))

    def shingles(self, doc: int) -> np.ndarray:
        s = self.cache.get(doc)
        if s is not None:
            self.cache.move_to_end(doc)
            return s
        text = json.loads(self.raw(doc))[self.text_key]
        s = shingle_set(text, self.spec)
        self.cache[doc] = s
        if len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        return s

    def jaccard(self, a: int, b: int) -> float:
        return jaccard_sorted(self.shingles(a), self.shingles(b))

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()

    def __enter__(self) -> DocStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verify_pairs(store: DocStore, pairs: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Verify candidate pairs (sorted) by exact Jaccard, skipping pairs already connected by verified pairs.

    Returns (accepted edges (m, 2), their exact Jaccard, number of Jaccard computations, number skipped).
    Skipping cannot change the connected components, only saves work.
    """
    index: dict[int, int] = {}
    uf = UnionFind(0)
    edges, js = [], []
    computed = skipped = 0
    for a, b in pairs.tolist():
        ia = index.setdefault(a, len(index))
        ib = index.setdefault(b, len(index))
        uf.grow(len(index))
        if uf.find(ia) == uf.find(ib):
            skipped += 1
            continue
        j = store.jaccard(a, b)
        computed += 1
        if j >= threshold:
            uf.union(ia, ib)
            edges.append((a, b))
            js.append(j)
    e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    return e, np.asarray(js, dtype=np.float64), computed, skipped
