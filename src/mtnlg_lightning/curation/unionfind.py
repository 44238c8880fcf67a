"""Union-find (disjoint sets) for clustering verified duplicate pairs."""

from __future__ import annotations

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components


class UnionFind:
    """Array-backed union-find with path halving and union by size (Python lists: fast scalar access)."""

    def __init__(self, n: int):
        self.parent = list(range(n))
        self.size = [1] * n

    def grow(self, n: int) -> None:
        """Add singleton elements until there are ``n``."""
        while len(self.parent) < n:
            self.parent.append(len(self.parent))
            self.size.append(1)

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        if self.size[ra] < self.size[rb]:
            ra, rb = rb, ra
        self.parent[rb] = ra
        self.size[ra] += self.size[rb]
        return True


def components(n: int, edges: np.ndarray) -> np.ndarray:
    """Connected-component label (0..k-1) of each of ``n`` elements given an (m, 2) edge array, in compiled code
    (scipy's csgraph; O(n + m) memory, no Python loop over the edges)."""
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    graph = coo_matrix((np.ones(len(edges), dtype=np.int8), (edges[:, 0], edges[:, 1])), shape=(n, n)).tocsr()
    return connected_components(graph, directed=False)[1].astype(np.int64)
