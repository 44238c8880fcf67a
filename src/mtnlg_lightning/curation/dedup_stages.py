"""Dedup's five stages and their tasks, over files in the run's work directory (``OUT/.dedup-work``)::

    signatures  sig/<shard>.npz + .sig.npy   one task per input shard (byte range of a file); then docs/*.npy
    buckets     buckets/band-<j>.npy         one task per LSH band: sorted candidate-pair codes a * n + b
    verify      verify/part-<p>.npz          one task per range of first documents: exact-Jaccard verified pairs
    clusters    clusters.npz                 one task: connected components, keeper of every document
    filter      final/<input name>           one task per input file; then final/duplicates.jsonl

Tasks are module-level functions ``task(ctx, item)`` that read what they need from the work directory (documents
by (file, offset), signatures memory-mapped), so they run the same in this process, in a local pool or on Ray.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from .jsonl import InputError, atomic_write, dumps_line, iter_lines
from .lsh import Banding, band_key, band_pairs, decode_pairs, pair_codes
from .signatures import (
    DocTable,
    Shard,
    SignatureReader,
    SignatureSettings,
    build_doc_table,
    compute_shard,
    estimated_jaccard_pairs,
    shard_meta_path,
)
from .stages import StageRunner
from .unionfind import components
from .verify import DocStore, verify_pairs

DUPLICATES_NAME = "duplicates.jsonl"
DOCS_PER_VERIFY_PARTITION = 50_000


@dataclass(frozen=True)
class DedupContext:
    """What every task needs: the inputs, the settings and where the work files are. Small, sent once."""

    work: str
    inputs: tuple[str, ...]  # absolute paths
    names: tuple[str, ...]
    shards: tuple[Shard, ...]
    file_rank: tuple[int, ...]
    signature: SignatureSettings
    id_key: str
    banding: Banding
    max_neighbors: int
    threshold: float
    estimate_margin: float

    def path(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    def docs(self) -> DocTable:
        return DocTable.load(self.path("docs"))

    def signatures(self, docs: DocTable) -> SignatureReader:
        return SignatureReader(self.path("sig"), list(self.shards), np.asarray(docs.shard_starts))

    def store(self, docs: DocTable) -> DocStore:
        sig = self.signature
        return DocStore(list(self.inputs), docs.file_idx, docs.offsets, docs.lengths, sig.text_key, sig.shingle)


# ----------------------------------------------------------------------------------------------------------
# signatures


class SignaturesStage:
    name = "signatures"

    def __init__(self, ctx: DedupContext):
        self.ctx = ctx

    def run(self, runner: StageRunner) -> dict:
        ctx = self.ctx
        sig_dir = ctx.path("sig")
        todo = [s for s in ctx.shards if not os.path.exists(shard_meta_path(sig_dir, s))]
        total = sum(s.end - s.start for s in ctx.shards)
        jobs = [(s, sig_dir) for s in todo]
        for _ in runner.map(
            self.name, compute_shard, jobs, ctx.signature, total=total, unit="B", size=lambda j: j[0].end - j[0].start
        ):
            pass
        docs = build_doc_table(sig_dir, list(ctx.shards), len(ctx.inputs), list(ctx.file_rank))
        counts = np.bincount(docs.file_idx, minlength=len(ctx.inputs))
        for fi, c in enumerate(counts):
            if c == 0:
                raise InputError(f"{ctx.inputs[fi]}: empty input (no records)")
        os.makedirs(ctx.path("docs"), exist_ok=True)
        docs.save(ctx.path("docs"))
        return {
            "docs": len(docs),
            "bytes": total,
            "shards": len(ctx.shards),
            "shards_resumed": len(ctx.shards) - len(todo),
            "workers": runner.engine.cpus,
        }


# ----------------------------------------------------------------------------------------------------------
# buckets


def band_path(ctx: DedupContext, band: int) -> str:
    return ctx.path("buckets", f"band-{band:04d}.npy")


def bucket_band(ctx: DedupContext, band: int) -> int:
    """Candidate pairs of one band (documents sharing the band's bucket), as sorted unique codes a * n + b."""
    path = band_path(ctx, band)
    if os.path.exists(path):
        return len(np.load(path, mmap_mode="r"))
    docs = ctx.docs()
    members = docs.lsh_members()
    r = ctx.banding.rows
    cols = ctx.signatures(docs).columns(band * r, (band + 1) * r, members)
    keys = band_key(cols, band)
    codes = np.unique(pair_codes(band_pairs(keys, members, ctx.max_neighbors), len(docs)))
    with atomic_write(path) as f:
        np.save(f, codes)
    return len(codes)


class BucketsStage:
    name = "buckets"

    def __init__(self, ctx: DedupContext):
        self.ctx = ctx

    def run(self, runner: StageRunner) -> dict:
        ctx = self.ctx
        os.makedirs(ctx.path("buckets"), exist_ok=True)
        total = sum(runner.map(self.name, bucket_band, list(range(ctx.banding.bands)), ctx, unit="band"))
        docs = ctx.docs()
        n = len(docs)
        return {
            "lsh_docs": int(len(docs.lsh_members())),
            "band_pairs": int(total),
            "exact_duplicate_docs": int(np.count_nonzero(np.asarray(docs.exact_rep) != np.arange(n))),
            # verification partitions: ranges of first documents; a fixed function of the corpus, not of the
            # engine or the workers, so every engine writes the same work files
            "verify_partitions": max(1, min(n // 16, max(4, math.ceil(n / DOCS_PER_VERIFY_PARTITION)))),
        }


# ----------------------------------------------------------------------------------------------------------
# verify


def verify_partition(ctx: DedupContext, job: tuple[int, int, int]) -> dict:
    """Verify the candidate pairs whose first document is in ``[lo, hi)``: unique over bands, estimate
    pre-rejection, exact Jaccard of the re-read documents."""
    part, lo, hi = job
    path = ctx.path("verify", f"part-{part:05d}.npz")
    if not os.path.exists(path):
        docs = ctx.docs()
        n = len(docs)
        slices = []
        for band in range(ctx.banding.bands):
            codes = np.load(band_path(ctx, band), mmap_mode="r")
            a, b = np.searchsorted(codes, [lo * n, hi * n])
            slices.append(np.asarray(codes[a:b]))
        pairs = decode_pairs(np.unique(np.concatenate(slices)), n)
        n_candidates = len(pairs)
        sigs = ctx.signatures(docs)
        # cheap pre-rejection: a pair whose MinHash estimate is far below the threshold cannot plausibly reach it
        # (for J >= threshold, P(estimate < threshold - margin) < 1e-4 at 256 permutations and margin 0.1)
        if ctx.estimate_margin >= 0 and len(pairs):  # a negative margin: verify every candidate exactly
            pairs = pairs[estimated_jaccard_pairs(sigs, pairs) >= ctx.threshold - ctx.estimate_margin]
        with ctx.store(docs) as store:
            edges, exact, computed, skipped = verify_pairs(store, pairs, ctx.threshold)
        counts = np.asarray([n_candidates, n_candidates - len(pairs), computed, skipped], dtype=np.int64)
        with atomic_write(path) as f:
            np.savez(f, edges=edges, exact=exact, estimated=estimated_jaccard_pairs(sigs, edges), counts=counts)
    with np.load(path) as z:
        cand, rejected, computed, skipped = z["counts"].tolist()
        return {
            "candidate_pairs": cand,
            "rejected_by_estimate": rejected,
            "jaccard_computed": computed,
            "skipped_already_connected": skipped,
            "verified_pairs": len(z["edges"]),
        }


class VerifyStage:
    name = "verify"

    def __init__(self, ctx: DedupContext):
        self.ctx = ctx

    def run(self, runner: StageRunner) -> dict:
        ctx = self.ctx
        os.makedirs(ctx.path("verify"), exist_ok=True)
        n = runner.stats["signatures"]["docs"]
        parts = runner.stats["buckets"]["verify_partitions"]
        bounds = np.linspace(0, n, parts + 1).round().astype(np.int64).tolist()
        jobs = [(p, bounds[p], bounds[p + 1]) for p in range(parts)]
        totals = dict.fromkeys(
            ("candidate_pairs", "rejected_by_estimate", "jaccard_computed", "skipped_already_connected"), 0
        )
        totals["verified_pairs"] = 0
        for stats in runner.map(self.name, verify_partition, jobs, ctx, unit="part"):
            for k, v in stats.items():
                totals[k] += v
        totals["rejected_pairs"] = totals["jaccard_computed"] - totals["verified_pairs"]
        totals["partitions"] = parts
        return totals


def verified_edges(ctx: DedupContext, parts: int) -> tuple[np.ndarray, np.ndarray]:
    edges, exact = [np.empty((0, 2), np.int64)], [np.empty(0)]
    for p in range(parts):
        with np.load(ctx.path("verify", f"part-{p:05d}.npz")) as z:
            edges.append(z["edges"])
            exact.append(z["exact"])
    return np.concatenate(edges), np.concatenate(exact)


# ----------------------------------------------------------------------------------------------------------
# clusters


def cluster_documents(ctx: DedupContext, parts: int) -> dict:
    """Connected components of the verified pairs and the exact-duplicate groups; keeper = best rank."""
    docs = ctx.docs()
    n = len(docs)
    rank, exact_rep = np.asarray(docs.rank), np.asarray(docs.exact_rep)
    edges, edge_j = verified_edges(ctx, parts)
    known = {(a, b): j for (a, b), j in zip(edges.tolist(), edge_j.tolist(), strict=True)}
    dups = np.flatnonzero(exact_rep != np.arange(n))
    labels = components(n, np.concatenate([edges, np.stack([dups, exact_rep[dups]], axis=1)]))
    best = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(best, labels, rank)
    by_rank = np.empty(n, dtype=np.int64)
    by_rank[rank] = np.arange(n)
    keeper = by_rank[best[labels]]
    removed = np.flatnonzero(keeper != np.arange(n))
    kind_exact = exact_rep[removed] == exact_rep[keeper[removed]]
    est = estimated_jaccard_pairs(ctx.signatures(docs), np.stack([removed, keeper[removed]], axis=1))
    exact_j = np.ones(len(removed))
    near = np.flatnonzero(~kind_exact)
    if len(near):
        with ctx.store(docs) as store:
            for i in near.tolist():
                a, b = int(exact_rep[removed[i]]), int(exact_rep[keeper[removed[i]]])
                j = known.get((min(a, b), max(a, b)))  # verified directly: reuse; else (transitive) compute
                exact_j[i] = j if j is not None else store.jaccard(int(removed[i]), int(keeper[removed[i]]))
    sizes = np.bincount(labels, minlength=n)
    sizes = sizes[sizes >= 2]
    with atomic_write(ctx.path("clusters.npz")) as f:
        np.savez(f, keeper=keeper, removed=removed, kind_exact=kind_exact, estimated=est, exact=exact_j)
    hist: dict[str, int] = {}
    for lo, hi in ((2, 2), (3, 3), (4, 7), (8, 15), (16, 63), (64, None)):
        m = (sizes >= lo) & (sizes <= hi) if hi else sizes >= lo
        if m.any():
            hist[f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi else f"{lo}+")] = int(m.sum())
    return {
        "clusters": int(len(sizes)),
        "docs_in_clusters": int(sizes.sum()),
        "largest_cluster": int(sizes.max()) if len(sizes) else 0,
        "size_histogram": hist,
        "removed_exact": int(kind_exact.sum()),
        "removed_near": int((~kind_exact).sum()),
    }


class ClustersStage:
    name = "clusters"

    def __init__(self, ctx: DedupContext):
        self.ctx = ctx

    def run(self, runner: StageRunner) -> dict:
        # one task (on Ray it runs on a worker, not in the driver): it needs the verified edges and ~50 bytes per
        # document, never the signatures of every document
        parts = runner.stats["verify"]["partitions"]
        (stats,) = runner.map(self.name, cluster_documents, [parts], self.ctx)
        return stats


# ----------------------------------------------------------------------------------------------------------
# filter


def filter_file(ctx: DedupContext, fi: int) -> tuple[int, int, dict[int, object]]:
    """Write the kept records of input ``fi`` (unchanged bytes, same order) into final/; return (docs in, docs
    kept, ids of this file's documents that duplicates.jsonl names)."""
    docs = ctx.docs()
    n = len(docs)
    with np.load(ctx.path("clusters.npz")) as z:
        keeper, removed = z["keeper"], z["removed"]
    file_idx = np.asarray(docs.file_idx)
    lo, hi = np.searchsorted(file_idx, [fi, fi + 1]).tolist()
    keep = keeper[lo:hi] == np.arange(lo, hi)
    need_id = np.zeros(n, dtype=bool)
    need_id[removed] = True
    need_id[keeper[removed]] = True
    need_id = need_id[lo:hi]
    offs = np.asarray(docs.offsets[lo:hi])
    lines = np.asarray(docs.lines[lo:hi])
    ids: dict[int, object] = {}
    d = 0
    kept = 0
    with atomic_write(ctx.path("final", ctx.names[fi]), fsync=True) as out:
        for off, line in iter_lines(ctx.inputs[fi]):
            if d >= hi - lo or off != offs[d]:
                continue  # blank line
            if keep[d]:
                out.write(line if line.endswith(b"\n") else line + b"\n")
                kept += 1
            if need_id[d]:
                rec = json.loads(line)
                ids[lo + d] = rec[ctx.id_key] if ctx.id_key in rec else f"{ctx.names[fi]}:{int(lines[d])}"
            d += 1
    return hi - lo, kept, ids


class FilterStage:
    name = "filter"

    def __init__(self, ctx: DedupContext):
        self.ctx = ctx

    def run(self, runner: StageRunner) -> dict:
        ctx = self.ctx
        os.makedirs(ctx.path("final"), exist_ok=True)
        ids: dict[int, object] = {}
        per_file = []
        for docs_in, kept, file_ids in runner.map(self.name, filter_file, list(range(len(ctx.inputs))), ctx):
            per_file.append((docs_in, kept))
            ids.update(file_ids)
        docs = ctx.docs()
        file_idx, lines = np.asarray(docs.file_idx), np.asarray(docs.lines)
        with np.load(ctx.path("clusters.npz")) as z:
            keeper, removed = z["keeper"], z["removed"]
            kind_exact, est, exact_j = z["kind_exact"], z["estimated"], z["exact"]
        with atomic_write(ctx.path("final", DUPLICATES_NAME), fsync=True) as out:
            for i, d in enumerate(removed.tolist()):
                k = int(keeper[d])
                out.write(
                    dumps_line(
                        {
                            "id": ids[d],
                            "source": ctx.names[int(file_idx[d])],
                            "line": int(lines[d]),
                            "duplicate_of": ids[k],
                            "duplicate_of_source": ctx.names[int(file_idx[k])],
                            "duplicate_of_line": int(lines[k]),
                            "kind": "exact" if kind_exact[i] else "near",
                            "estimated_jaccard": round(float(est[i]), 4),
                            "exact_jaccard": round(float(exact_j[i]), 4),
                        }
                    )
                )
        rem_file = file_idx[removed]
        inputs = []
        for fi in range(len(ctx.inputs)):
            m = rem_file == fi
            inputs.append(
                {
                    "docs_in": per_file[fi][0],
                    "docs_out": per_file[fi][1],
                    "exact_duplicates_removed": int(np.count_nonzero(kind_exact[m])),
                    "near_duplicates_removed": int(np.count_nonzero(~kind_exact[m])),
                }
            )
        return {"inputs": inputs}


def dedup_stages(ctx: DedupContext) -> list:
    return [SignaturesStage(ctx), BucketsStage(ctx), VerifyStage(ctx), ClustersStage(ctx), FilterStage(ctx)]
