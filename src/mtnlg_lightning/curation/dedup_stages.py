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

from mtnlg_lightning.corpora.formats import Format
from mtnlg_lightning.corpora.jsonl import InputError, atomic_write, dumps_line
from mtnlg_lightning.corpora.mapcache import load_map
from mtnlg_lightning.corpora.records import BAD_REASONS
from mtnlg_lightning.corpora.stages import ContextStage, StageRunner
from mtnlg_lightning.corpora.writers import encode_jsonl, filter_parquet
from mtnlg_lightning.curation.lsh import Banding, band_pairs, decode_pairs, pair_codes
from mtnlg_lightning.curation.signatures import (
    DocTable,
    Shard,
    SignatureReader,
    SignatureSettings,
    build_doc_table,
    compute_shard,
    estimated_jaccard_pairs,
    shard_keys_path,
    shard_meta_path,
)
from mtnlg_lightning.curation.unionfind import components
from mtnlg_lightning.curation.verify import DocStore, verify_pairs

DUPLICATES_NAME = "duplicates.jsonl"
DOCS_PER_VERIFY_PARTITION = 50_000
VERIFY_PARTITIONS_MIN = 8
DOCS_PER_BUCKET_PARTITION = 1 << 23


@dataclass(frozen=True)
class DedupContext:
    """What every task needs: the inputs, the settings and where the work files are. Small, sent once."""

    work: str
    inputs: tuple[str, ...]  # absolute paths of the plain JSON lines read (the inputs or their plain copies)
    names: tuple[str, ...]  # input names (reports)
    out_names: tuple[str, ...]  # output names, relative to the output directory
    sources: tuple[str, ...]  # absolute paths of the inputs as given
    formats: tuple[Format, ...]  # each input's format
    output_compression: str | None  # None: as the input
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


def signature_task(ctx: DedupContext, shard: Shard) -> int:
    """One input shard: MinHash signatures, LSH band keys and per-document facts (see :func:`compute_shard`)."""
    return compute_shard(ctx.signature, (shard, ctx.path("sig")), ctx.banding)


class SignaturesStage(ContextStage[DedupContext]):
    name = "signatures"

    def run(self, runner: StageRunner) -> dict:
        ctx = self.ctx
        sig_dir = ctx.path("sig")
        todo = [s for s in ctx.shards if not os.path.exists(shard_meta_path(sig_dir, s))]
        total = sum(s.end - s.start for s in ctx.shards)
        # the largest shards first (each file's last one is short): the stage ends with small tasks, so the
        # workers finish together; results are not order-dependent (every task writes its own files)
        todo.sort(key=lambda s: s.start - s.end)
        size = lambda s: s.end - s.start  # noqa: E731
        for _ in runner.map(self.name, signature_task, todo, ctx, total=total, unit="B", size=size):
            pass
        docs = build_doc_table(sig_dir, list(ctx.shards), len(ctx.inputs), list(ctx.file_rank))
        counts = np.bincount(docs.file_idx, minlength=len(ctx.inputs))
        for fi, c in enumerate(counts):
            if c == 0:
                raise InputError(f"{ctx.sources[fi]}: empty input (no records)")
        bad = np.zeros(len(BAD_REASONS), np.int64)
        for s in ctx.shards:
            with np.load(shard_meta_path(sig_dir, s)) as z:
                bad += z["bad"]
        os.makedirs(ctx.path("docs"), exist_ok=True)
        docs.save(ctx.path("docs"))
        return {
            "docs": len(docs),
            "bytes": total,
            "shards": len(ctx.shards),
            "shards_resumed": len(ctx.shards) - len(todo),
            "workers": runner.engine.cpus,
            "bad_records": dict(zip(BAD_REASONS, bad.tolist(), strict=True)),
        }


# ----------------------------------------------------------------------------------------------------------
# buckets


def band_path(ctx: DedupContext, band: int, part: int) -> str:
    return ctx.path("buckets", f"band-{band:04d}-{part:04d}.npy")


def band_paths(ctx: DedupContext, n: int) -> list[str]:
    """Every bucket task's file of candidate pair codes (each band split into its key-hash partitions)."""
    return [band_path(ctx, band, part) for band in range(ctx.banding.bands) for part in range(bucket_partitions(n))]


def bucket_partitions(n: int) -> int:
    """Key-hash partitions per band: a fixed function of the corpus size (never of the engine or workers), so
    that a bucket task holds at most ~``DOCS_PER_BUCKET_PARTITION`` keys and their pairs."""
    return max(1, math.ceil(n / DOCS_PER_BUCKET_PARTITION))


def verify_partitions(n: int) -> int:
    return max(1, min(n // 16, max(VERIFY_PARTITIONS_MIN, math.ceil(n / DOCS_PER_VERIFY_PARTITION))))


def bucket_band(ctx: DedupContext, job: tuple[int, int, int]) -> int:
    """Candidate pairs of one band among the LSH documents whose band key is in hash partition ``part`` (a
    bucket lies in one partition), as sorted unique codes a * n + b. Reads the band's row of every shard's key
    file and the two document-table columns that say which documents go through LSH, shard by shard."""
    band, part, parts = job
    path = band_path(ctx, band, part)
    if os.path.exists(path):
        return len(load_map(path))
    docs = ctx.docs()
    starts = np.asarray(docs.shard_starts).tolist()
    keys, members = [], []
    for s, shard in enumerate(ctx.shards):
        ids = docs.lsh_members(starts[s], starts[s + 1])
        if not len(ids):
            continue
        k = np.asarray(load_map(shard_keys_path(ctx.path("sig"), shard))[band][ids - starts[s]])
        if parts > 1:
            m = k % np.uint64(parts) == np.uint64(part)
            k, ids = k[m], ids[m]
        keys.append(k)
        members.append(ids)
    keys_a = np.concatenate(keys) if keys else np.empty(0, np.uint64)
    members_a = np.concatenate(members) if members else np.empty(0, np.int64)
    codes = np.unique(pair_codes(band_pairs(keys_a, members_a, ctx.max_neighbors), len(docs)))
    with atomic_write(path) as f:
        np.save(f, codes)
    return len(codes)


class PairStage(ContextStage[DedupContext]):
    """A stage over the candidate pairs of the signed documents: its work files in a folder of its name."""

    def signed_documents(self, runner: StageRunner) -> int:
        """How many documents the signatures stage signed; this stage's work folder made."""
        os.makedirs(self.ctx.path(self.name), exist_ok=True)
        return runner.stats["signatures"]["docs"]


class BucketsStage(PairStage):
    name = "buckets"

    def run(self, runner: StageRunner) -> dict:
        ctx, n = self.ctx, self.signed_documents(runner)
        parts = bucket_partitions(n)
        jobs = [(band, part, parts) for band in range(ctx.banding.bands) for part in range(parts)]
        total = sum(runner.map(self.name, bucket_band, jobs, ctx, unit="band"))
        docs = ctx.docs()
        return {
            "lsh_docs": int(len(docs.lsh_members())),
            "band_pairs": int(total),
            "bucket_partitions": parts,
            "exact_duplicate_docs": int(np.count_nonzero(np.asarray(docs.exact_rep) != np.arange(n))),
            # verification partitions: ranges of first documents; a fixed function of the corpus, not of the
            # engine or the workers, so every engine writes the same work files
            "verify_partitions": verify_partitions(n),
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
        for band_file in band_paths(ctx, n):
            codes = load_map(band_file)
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


class VerifyStage(PairStage):
    name = "verify"

    def run(self, runner: StageRunner) -> dict:
        ctx, n = self.ctx, self.signed_documents(runner)
        parts = runner.stats["buckets"]["verify_partitions"]
        bounds = np.linspace(0, n, parts + 1).round().astype(np.int64).tolist()
        jobs = [(p, bounds[p], bounds[p + 1]) for p in range(parts)]
        # the partitions with the most band pairs first, so that the workers finish about together (each writes
        # its own file; the totals are sums, whatever the order)
        weight = np.zeros(parts, np.int64)
        code_bounds = np.asarray(bounds, dtype=np.int64) * np.int64(n)
        for band_file in band_paths(ctx, n):
            weight += np.diff(np.searchsorted(load_map(band_file), code_bounds))
        jobs.sort(key=lambda job: -int(weight[job[0]]))
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


def clusters_path(ctx: DedupContext, name: str) -> str:
    return ctx.path("clusters", name + ".npy")


def cluster_documents(ctx: DedupContext, parts: int) -> dict:
    """Connected components of the verified pairs and the exact-duplicate groups; keeper = best rank. Writes the
    keeper of every document and the verified pairs as sorted codes with their exact Jaccard (the filter tasks
    look up the pairs they report)."""
    docs = ctx.docs()
    n = len(docs)
    rank, exact_rep = np.asarray(docs.rank), np.asarray(docs.exact_rep)
    edges, edge_j = verified_edges(ctx, parts)
    dups = np.flatnonzero(exact_rep != np.arange(n))
    labels = components(n, np.concatenate([edges, np.stack([dups, exact_rep[dups]], axis=1)]))
    best = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(best, labels, rank)
    by_rank = np.empty(n, dtype=np.int64)
    by_rank[rank] = np.arange(n)
    keeper = by_rank[best[labels]]
    removed = np.flatnonzero(keeper != np.arange(n))
    kind_exact = exact_rep[removed] == exact_rep[keeper[removed]]
    codes = pair_codes(edges, n)
    order = np.argsort(codes, kind="stable")
    sizes = np.bincount(labels, minlength=n)
    sizes = sizes[sizes >= 2]
    os.makedirs(ctx.path("clusters"), exist_ok=True)
    for name, arr in (("edge_codes", codes[order]), ("edge_jaccard", edge_j[order]), ("keeper", keeper)):
        with atomic_write(clusters_path(ctx, name)) as f:  # keeper last: it marks the task finished
            np.save(f, arr)
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


class ClustersStage(ContextStage[DedupContext]):
    name = "clusters"

    def run(self, runner: StageRunner) -> dict:
        # one task (on Ray it runs on a worker, not in the driver): it needs the verified edges and ~50 bytes per
        # document, never the signatures of every document; compiled connected components, no Python loop
        parts = runner.stats["verify"]["partitions"]
        (stats,) = runner.map(self.name, cluster_documents, [parts], self.ctx)
        return stats


# ----------------------------------------------------------------------------------------------------------
# filter


def _record_id(ctx: DedupContext, line: bytes, fi: int, lineno: int) -> object:
    rec = json.loads(line)
    return rec[ctx.id_key] if ctx.id_key in rec else f"{ctx.names[fi]}:{lineno}"


def kept_part_path(ctx: DedupContext, shard: Shard) -> str:
    return ctx.path("kept", shard.name + ".jsonl")


def filter_shard(ctx: DedupContext, s: int) -> tuple[int, int, int, bytes]:
    """One signature shard's part of the filter: write its kept records (unchanged bytes, same order, a final
    newline added where the input's last line had none) to its own part file, and return (docs kept, exact and
    near duplicates removed, this shard's duplicates.jsonl lines). A line names the removed document, its keeper
    (read by (file, offset) when it is in another shard), the MinHash estimate and the exact Jaccard (the verified
    pair's, else computed from the two documents)."""
    shard = ctx.shards[s]
    docs = ctx.docs()
    lo, hi = (int(x) for x in docs.shard_starts[s : s + 2])
    keeper = load_map(clusters_path(ctx, "keeper"))
    ids = np.arange(lo, hi, dtype=np.int64)
    kp = np.asarray(keeper[lo:hi])
    keep = kp == ids
    rel = (np.asarray(docs.offsets[lo:hi]) - shard.start).astype(np.int64)
    lens = np.asarray(docs.lengths[lo:hi]).astype(np.int64)
    with open(shard.path, "rb") as f:
        f.seek(shard.start)
        data = f.read(shard.end - shard.start)
    kept = [data[o : o + ln] for o, ln in zip(rel[keep].tolist(), lens[keep].tolist(), strict=True)]
    if kept and not kept[-1].endswith(b"\n"):
        kept[-1] += b"\n"
    with atomic_write(kept_part_path(ctx, shard)) as f:
        f.write(b"".join(kept))
    rm = np.flatnonzero(~keep)
    if not len(rm):
        return int(keep.sum()), 0, 0, b""
    removed, keepers = ids[rm], kp[rm]
    rep_r, rep_k = np.asarray(docs.exact_rep[removed]), np.asarray(docs.exact_rep[keepers])
    kind_exact = rep_r == rep_k
    est = estimated_jaccard_pairs(ctx.signatures(docs), np.stack([removed, keepers], axis=1))
    exact_j = _exact_jaccards(ctx, docs, removed, keepers, rep_r, rep_k)

    def in_shard(d: int) -> bytes | None:
        return data[int(rel[d - lo]) : int(rel[d - lo]) + int(lens[d - lo])] if lo <= d < hi else None

    lines = _duplicates_jsonl(ctx, docs, removed, keepers, kind_exact, est, exact_j, in_shard)
    return int(keep.sum()), int(kind_exact.sum()), int((~kind_exact).sum()), lines


def _exact_jaccards(ctx: DedupContext, docs, removed, keepers, rep_r, rep_k) -> np.ndarray:
    """The exact Jaccard of each removed document and its keeper: 1 for exact duplicates (same representative),
    the verified edge's for a near pair, else (connected through a chain) computed from the two documents."""
    exact_j = np.ones(len(removed))
    near = np.flatnonzero(rep_r != rep_k)
    if len(near):
        n = len(docs)
        edge_codes = load_map(clusters_path(ctx, "edge_codes"))
        edge_j = load_map(clusters_path(ctx, "edge_jaccard"))
        q = np.minimum(rep_r[near], rep_k[near]) * np.int64(n) + np.maximum(rep_r[near], rep_k[near])
        pos = np.minimum(np.searchsorted(edge_codes, q), max(len(edge_codes) - 1, 0))
        found = (np.asarray(edge_codes[pos]) == q) if len(edge_codes) else np.zeros(len(q), bool)
        exact_j[near[found]] = np.asarray(edge_j[pos[found]])
        todo = near[~found]  # connected through a chain: compute it from the two documents
        if len(todo):
            with ctx.store(docs) as store:
                for i in todo.tolist():
                    exact_j[i] = store.jaccard(int(removed[i]), int(keepers[i]))
    return exact_j


def _duplicates_jsonl(ctx: DedupContext, docs, removed, keepers, kind_exact, est, exact_j, in_shard) -> bytes:
    """One duplicates.jsonl line per removed document. A document's id is read from its record: from the shard's
    bytes (`in_shard(d)`) when it lies in this shard, else from its input file; each document's once."""
    file_idx, lines, offsets, lengths = docs.file_idx, docs.lines, docs.offsets, docs.lengths
    id_of: dict[int, object] = {}
    handles: dict[int, object] = {}

    def record_id(d: int) -> object:
        got = id_of.get(d, id_of)
        if got is not id_of:
            return got
        fi = int(file_idx[d])
        line = in_shard(d)
        if line is None:
            fh = handles.get(fi)
            if fh is None:
                fh = handles[fi] = open(ctx.inputs[fi], "rb")  # noqa: SIM115 - closed below
            fh.seek(int(offsets[d]))
            line = fh.read(int(lengths[d]))
        got = id_of[d] = _record_id(ctx, line, fi, int(lines[d]))
        return got

    out = []
    try:
        for i, (d, k) in enumerate(zip(removed.tolist(), keepers.tolist(), strict=True)):
            out.append(
                dumps_line(
                    {
                        "id": record_id(d),
                        "source": ctx.names[int(file_idx[d])],
                        "line": int(lines[d]),
                        "duplicate_of": record_id(k),
                        "duplicate_of_source": ctx.names[int(file_idx[k])],
                        "duplicate_of_line": int(lines[k]),
                        "kind": "exact" if kind_exact[i] else "near",
                        "estimated_jaccard": round(float(est[i]), 4),
                        "exact_jaccard": round(float(exact_j[i]), 4),
                    }
                )
            )
    finally:
        for fh in handles.values():
            fh.close()
    return b"".join(out)


def publish_output(ctx: DedupContext, fi: int) -> None:
    """Input ``fi``'s kept records (its shards' part files, in order) to ``final/<output name>`` in the input's
    format: plain JSON lines as they are, compressed or made a JSON array, or, for parquet, the input's kept rows
    with its schema."""
    dest = ctx.path("final", ctx.out_names[fi])
    parts = [kept_part_path(ctx, shard) for shard in ctx.shards if shard.file_idx == fi]
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    fmt = ctx.formats[fi]
    if fmt.kind == "parquet":
        docs = ctx.docs()
        kept = np.asarray(load_map(clusters_path(ctx, "keeper"))) == np.arange(len(docs))
        keep = np.flatnonzero((np.asarray(docs.file_idx) == fi) & kept)
        filter_parquet(ctx.sources[fi], dest, np.asarray(docs.lines)[keep].astype(np.int64) - 1)
    else:
        encode_jsonl(parts, dest, Format(fmt.kind, ctx.output_compression or fmt.compression))
    for part in parts:
        os.unlink(part)


class FilterStage(ContextStage[DedupContext]):
    """Kept records and duplicates.jsonl, one task per signature shard (so also parallel for one input file): each
    writes its shard's kept records to a part file of its own and returns its duplicates.jsonl lines, in document
    order; then one task per input joins its parts into the output. No file is written by two tasks, so the tasks
    may run on machines that share no file system (:mod:`mtnlg_lightning.corpora.mirror`)."""

    name = "filter"

    def run(self, runner: StageRunner) -> dict:
        ctx = self.ctx
        os.makedirs(ctx.path("final"), exist_ok=True)
        os.makedirs(ctx.path("kept"), exist_ok=True)
        file_idx = np.asarray(ctx.docs().file_idx)
        jobs = list(range(len(ctx.shards)))
        per_file = np.zeros((len(ctx.inputs), 3), np.int64)  # kept, exact removed, near removed
        with atomic_write(ctx.path("final", DUPLICATES_NAME), fsync=True) as out:
            for s, (kept, n_exact, n_near, lines) in zip(
                jobs, runner.map(self.name, filter_shard, jobs, ctx), strict=True
            ):
                per_file[ctx.shards[s].file_idx] += (kept, n_exact, n_near)
                out.write(lines)
        for _ in runner.engine.map(publish_output, list(range(len(ctx.inputs))), ctx):
            pass
        counts = np.bincount(file_idx, minlength=len(ctx.inputs))
        inputs = [
            {
                "docs_in": int(counts[fi]),
                "docs_out": int(per_file[fi, 0]),
                "exact_duplicates_removed": int(per_file[fi, 1]),
                "near_duplicates_removed": int(per_file[fi, 2]),
            }
            for fi in range(len(ctx.inputs))
        ]
        return {"inputs": inputs}


def dedup_stages(ctx: DedupContext) -> list:
    return [SignaturesStage(ctx), BucketsStage(ctx), VerifyStage(ctx), ClustersStage(ctx), FilterStage(ctx)]
