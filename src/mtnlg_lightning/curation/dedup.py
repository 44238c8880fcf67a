"""Fuzzy document deduplication: exact-duplicate removal, MinHash LSH with explicit banding, exact-Jaccard
verification, union-find clusters, priority keep.

The pipeline is a chain of restartable, file-based stages inside ``OUT/.dedup-work/``::

    signatures  one .npz per input shard (byte range of a file): offsets, exact-dup keys, MinHash signatures
    buckets     one .npy per LSH band: candidate pairs of documents sharing that band's bucket
    verify      verified.npz: candidate pairs whose exact Jaccard >= threshold (a spanning forest of them)
    clusters    clusters.npz: keeper of every document (connected components, priority keep)
    filter      final/<input name>.jsonl + final/duplicates.jsonl, then published into OUT/ and report.json

Every file is written atomically (temp + ``os.replace``) and every stage ends with a ``<stage>.done`` marker
holding its statistics, so a killed run re-run with the same output directory resumes at the first unfinished
stage (signature shards individually); a run with different inputs or settings starts clean.  ``report.json``
is written last: an output directory without it is never a finished result.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
from dataclasses import dataclass, field

import numpy as np

from .jsonl import (
    InputError,
    atomic_write,
    check_input_files,
    dumps_line,
    iter_lines,
    line_starts_plan,
    write_json_atomic,
)
from .lsh import DEFAULT_BANDING, DEFAULT_MAX_NEIGHBORS, Banding, band_keys, band_pairs, decode_pairs, pair_codes
from .shingles import ShingleSpec
from .signatures import Corpus, compute_shard, load_corpus, shard_name
from .unionfind import UnionFind
from .verify import DocStore, _close_store, _init_store, verify_chunk

WORK_DIR_NAME = ".dedup-work"
STAGES = ("signatures", "buckets", "verify", "clusters", "filter")
REPORT_NAME = "report.json"
DUPLICATES_NAME = "duplicates.jsonl"
FORMAT_VERSION = 1
_CRASH_ENV = "MTNLG_DEDUP_CRASH_AT"  # testing hook: simulate a kill (os._exit) at a named point


def _maybe_crash(point: str) -> None:
    if os.environ.get(_CRASH_ENV) == point:
        os._exit(86)


def hash_scheme_description(scheme: str, seed: int, num_perm: int) -> str:
    if scheme == "affine32":
        perm = "datasketch 'affine32': fmix32(h) then a*h+b mod 2^32"
    else:
        perm = "datasketch 'legacy': (a*h+b mod 2^61-1) & 0xFFFFFFFF"
    return f"{perm}; {num_perm} permutations from datasketch.MinHash(seed={seed}); h = low 32 bits of the shingle hash"


@dataclass
class DedupConfig:
    inputs: list[str]
    output_dir: str
    text_key: str = "text"
    id_key: str = "id"
    threshold: float = 0.8
    banding: Banding = DEFAULT_BANDING
    shingle: ShingleSpec = field(default_factory=ShingleSpec)
    scheme: str = "affine32"
    seed: int = 1
    priority: list[str] | None = None
    workers: int = 1
    shard_bytes: int = 16 << 20
    max_neighbors: int = DEFAULT_MAX_NEIGHBORS
    estimate_margin: float = 0.1
    progress: bool = True
    keep_work: bool = False
    force: bool = False
    preset: str = "default"

    @property
    def num_perm(self) -> int:
        return self.banding.num_perm

    def settings(self) -> dict:
        return {
            "text_key": self.text_key,
            "id_key": self.id_key,
            "threshold": self.threshold,
            "bands": self.banding.bands,
            "rows_per_band": self.banding.rows,
            "num_perm": self.num_perm,
            "shingle": str(self.shingle),
            "scheme": self.scheme,
            "seed": self.seed,
            "max_bucket_neighbors": self.max_neighbors,
            "estimate_margin": self.estimate_margin,
        }


# ----------------------------------------------------------------------------------------------------------
# The pipeline.


class _Progress:
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, **kw):
        from tqdm.auto import tqdm

        return tqdm(disable=not self.enabled, dynamic_ncols=True, leave=False, **kw)


class DedupRun:
    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg
        self.out = cfg.output_dir
        self.work = os.path.join(self.out, WORK_DIR_NAME)
        self.names = [os.path.basename(p) for p in cfg.inputs]
        self.paths = [os.path.abspath(p) for p in cfg.inputs]
        self.progress = _Progress(cfg.progress)
        self.stage_stats: dict[str, dict] = {}
        self.resumed: list[str] = []
        self.created_out = False
        self.corpus: Corpus | None = None

    # -- setup / validation ------------------------------------------------------------------------------
    def validate(self) -> None:
        cfg = self.cfg
        if not cfg.inputs:
            raise InputError("no input files given")
        check_input_files(cfg.inputs)
        seen: dict[str, str] = {}
        for p, name in zip(cfg.inputs, self.names, strict=True):
            if name in seen:
                raise InputError(
                    f"two inputs have the same file name {name!r} ({seen[name]}, {p}); outputs would collide"
                )
            if name in (DUPLICATES_NAME, REPORT_NAME):
                raise InputError(f"{p}: input file name {name!r} collides with an output file name")
            seen[name] = p
        real_inputs = {os.path.realpath(p) for p in cfg.inputs}
        for name in self.names:
            if os.path.realpath(os.path.join(self.out, name)) in real_inputs:
                raise InputError(
                    f"output {os.path.join(self.out, name)} would overwrite an input; choose another --output-dir"
                )
        if not 0.0 < cfg.threshold <= 1.0:
            raise InputError(f"--threshold must be in (0, 1], got {cfg.threshold}")
        self.file_rank = self._file_rank()

    def _file_rank(self) -> list[int]:
        order: list[int] = []
        for item in self.cfg.priority or []:
            matches = [
                i
                for i, p in enumerate(self.cfg.inputs)
                if item == p or os.path.abspath(item) == self.paths[i] or item == self.names[i]
            ]
            if not matches:
                raise InputError(f"--priority names {item!r}, which is not one of the inputs")
            if matches[0] not in order:
                order.append(matches[0])
        order += [i for i in range(len(self.cfg.inputs)) if i not in order]
        rank = [0] * len(order)
        for r, i in enumerate(order):
            rank[i] = r
        return rank

    def fingerprint(self) -> dict:
        files = []
        for p in self.paths:
            st = os.stat(p)
            files.append({"path": p, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        return {
            "format": FORMAT_VERSION,
            "inputs": files,
            "priority": [self.names[i] for i in sorted(range(len(self.names)), key=lambda i: self.file_rank[i])],
            **self.cfg.settings(),
        }

    def output_files(self) -> list[str]:
        return [os.path.join(self.out, n) for n in self.names] + [os.path.join(self.out, DUPLICATES_NAME)]

    def _remove_outputs(self) -> None:
        for p in [os.path.join(self.out, REPORT_NAME)] + self.output_files():
            if os.path.lexists(p):
                os.unlink(p)

    def _done_path(self, stage: str) -> str:
        return os.path.join(self.work, f"{stage}.done")

    def _is_done(self, stage: str) -> bool:
        return os.path.exists(self._done_path(stage))

    def _mark_done(self, stage: str, stats: dict) -> None:
        write_json_atomic(self._done_path(stage), stats)
        self.stage_stats[stage] = stats
        _maybe_crash(stage)

    def _load_done(self, stage: str) -> dict:
        with open(self._done_path(stage)) as f:
            stats = json.load(f)
        self.stage_stats[stage] = stats
        self.resumed.append(stage)
        return stats

    def prepare(self) -> dict | None:
        """Decide between 'already complete', 'resume' and 'start clean'. Returns the report if complete."""
        fp = self.fingerprint()
        self.fp = fp
        report_path = os.path.join(self.out, REPORT_NAME)
        if not os.path.isdir(self.out):
            os.makedirs(self.out)
            self.created_out = True
        work_cfg = os.path.join(self.work, "config.json")
        if not self.cfg.force and not os.path.exists(self.work) and os.path.exists(report_path):
            try:
                with open(report_path) as f:
                    report = json.load(f)
                if report.get("fingerprint") == fp and all(os.path.exists(p) for p in self.output_files()):
                    report["already_complete"] = True
                    return report
            except (OSError, ValueError):
                pass
        resume = False
        if os.path.exists(self.work):
            try:
                with open(work_cfg) as f:
                    saved = json.load(f)
                resume = not self.cfg.force and saved.get("fingerprint") == fp
            except (OSError, ValueError):
                resume = False
            if resume:
                self.plan = [tuple(x) for x in saved["plan"]]
            else:
                shutil.rmtree(self.work)
        # never leave an old report next to outputs that are being recomputed
        if os.path.exists(report_path):
            os.unlink(report_path)
        if not (resume and self._is_done("filter")):
            self._remove_outputs()
        if not resume:
            os.makedirs(os.path.join(self.work, "sig"))
            os.makedirs(os.path.join(self.work, "buckets"))
            os.makedirs(os.path.join(self.work, "final"))
            self.plan = []
            for fi, p in enumerate(self.paths):
                for si, (s, e) in enumerate(line_starts_plan(p, self.cfg.shard_bytes)):
                    self.plan.append((fi, si, s, e))
            write_json_atomic(work_cfg, {"fingerprint": fp, "plan": self.plan})
        return None

    def cleanup_after_error(self) -> None:
        """Bad input: leave nothing behind (work dir, outputs, and the output dir if we created it)."""
        shutil.rmtree(self.work, ignore_errors=True)
        self._remove_outputs()
        if self.created_out:
            try:
                os.rmdir(self.out)
            except OSError:
                pass

    # -- stages ------------------------------------------------------------------------------------------
    def stage_signatures(self) -> None:
        if self._is_done("signatures"):
            self._load_done("signatures")
            return
        t0 = time.perf_counter()
        cfg = self.cfg
        sig_dir = os.path.join(self.work, "sig")
        todo = []
        done_bytes = 0
        for fi, si, s, e in self.plan:
            out_file = os.path.join(sig_dir, shard_name(fi, si))
            if os.path.exists(out_file):
                done_bytes += e - s
                continue
            todo.append(
                (self.paths[fi], s, e, out_file, cfg.text_key, str(cfg.shingle), cfg.num_perm, cfg.seed, cfg.scheme)
            )
        total_bytes = sum(e - s for _, _, s, e in self.plan)
        bar = self.progress(total=total_bytes, initial=done_bytes, unit="B", unit_scale=True, desc="signatures")
        workers = max(1, min(cfg.workers, len(todo)))
        try:
            if workers == 1:
                for i, task in enumerate(todo):
                    res = compute_shard(task)
                    bar.update(task[2] - task[1])
                    _maybe_crash(f"signatures:shard{i + 1}")
                    del res
            else:
                with multiprocessing.Pool(workers) as pool:
                    for task, _ in zip(todo, pool.imap(compute_shard, todo), strict=True):
                        bar.update(task[2] - task[1])
        finally:
            bar.close()
        self.corpus = load_corpus(sig_dir, self.plan, len(self.paths), self.file_rank)
        counts = np.bincount(self.corpus.file_idx, minlength=len(self.paths))
        for fi, c in enumerate(counts):
            if c == 0:
                raise InputError(f"{self.cfg.inputs[fi]}: empty input (no records)")
        self._mark_done(
            "signatures",
            {
                "seconds": time.perf_counter() - t0,
                "docs": len(self.corpus),
                "bytes": total_bytes,
                "shards": len(self.plan),
                "shards_resumed": len(self.plan) - len(todo),
                "workers": workers,
            },
        )

    def _corpus(self) -> Corpus:
        if self.corpus is None:
            self.corpus = load_corpus(os.path.join(self.work, "sig"), self.plan, len(self.paths), self.file_rank)
        return self.corpus

    def stage_buckets(self) -> None:
        if self._is_done("buckets"):
            self._load_done("buckets")
            return
        t0 = time.perf_counter()
        c = self._corpus()
        n = len(c)
        members = np.flatnonzero((c.exact_rep == np.arange(n)) & (c.nsh > 0))
        keys = band_keys(c.sigs[members], self.cfg.banding)
        total = 0
        bdir = os.path.join(self.work, "buckets")
        for j in range(self.cfg.banding.bands):
            path = os.path.join(bdir, f"band-{j:04d}.npy")
            if os.path.exists(path):
                continue
            codes = pair_codes(band_pairs(keys[:, j], members, self.cfg.max_neighbors), n)
            with atomic_write(path) as f:
                np.save(f, codes)
            total += len(codes)
        self._mark_done(
            "buckets",
            {
                "seconds": time.perf_counter() - t0,
                "lsh_docs": int(len(members)),
                "band_pairs": int(total),
                "exact_duplicate_docs": int(np.count_nonzero(c.exact_rep != np.arange(n))),
            },
        )

    def _store_args(self) -> tuple:
        c = self._corpus()
        return (self.paths, c.file_idx, c.offsets, c.lengths, self.cfg.text_key, str(self.cfg.shingle))

    def stage_verify(self) -> None:
        if self._is_done("verify"):
            self._load_done("verify")
            return
        t0 = time.perf_counter()
        c = self._corpus()
        n = len(c)
        bdir = os.path.join(self.work, "buckets")
        codes = [np.load(os.path.join(bdir, f"band-{j:04d}.npy")) for j in range(self.cfg.banding.bands)]
        pairs = decode_pairs(np.unique(np.concatenate(codes)), n)
        del codes
        n_candidates = len(pairs)
        # cheap pre-rejection: a pair whose MinHash estimate is far below the threshold cannot plausibly reach it
        # (for J >= threshold, P(estimate < threshold - margin) < 1e-4 at 256 permutations and margin 0.1)
        est = (
            np.concatenate(
                [
                    (c.sigs[pairs[s : s + 65536, 0]] == c.sigs[pairs[s : s + 65536, 1]]).mean(axis=1)
                    for s in range(0, len(pairs), 65536)
                ]
            )
            if len(pairs)
            else np.empty(0)
        )
        if self.cfg.estimate_margin >= 0:  # a negative margin: verify every candidate exactly
            pairs = pairs[est >= self.cfg.threshold - self.cfg.estimate_margin]
        workers = self.cfg.workers if len(pairs) >= 20000 else 1
        bar = self.progress(total=len(pairs), unit="pair", desc="verify")
        edges, js, computed, skipped = [], [], 0, 0
        try:
            if workers <= 1:
                _init_store(*self._store_args())
                step = 50000
                for s in range(0, len(pairs), step):
                    e, j, cpt, skp = verify_chunk((pairs[s : s + step], self.cfg.threshold))
                    edges.append(e), js.append(j)
                    computed += cpt
                    skipped += skp
                    bar.update(min(step, len(pairs) - s))
                _close_store()
            else:
                chunks = np.array_split(pairs, workers * 8)
                with multiprocessing.Pool(workers, initializer=_init_store, initargs=self._store_args()) as pool:
                    for ch, (e, j, cpt, skp) in zip(
                        chunks, pool.imap(verify_chunk, [(ch, self.cfg.threshold) for ch in chunks]), strict=True
                    ):
                        edges.append(e), js.append(j)
                        computed += cpt
                        skipped += skp
                        bar.update(len(ch))
        finally:
            bar.close()
        e = np.concatenate(edges) if edges else np.empty((0, 2), np.int64)
        j = np.concatenate(js) if js else np.empty(0)
        est = (c.sigs[e[:, 0]] == c.sigs[e[:, 1]]).mean(axis=1) if len(e) else np.empty(0)
        with atomic_write(os.path.join(self.work, "verified.npz")) as f:
            np.savez(f, edges=e, exact=j, estimated=est)
        self._mark_done(
            "verify",
            {
                "seconds": time.perf_counter() - t0,
                "candidate_pairs": int(n_candidates),
                "rejected_by_estimate": int(n_candidates - len(pairs)),
                "jaccard_computed": computed,
                "skipped_already_connected": skipped,
                "verified_pairs": int(len(e)),
                "rejected_pairs": computed - int(len(e)),
            },
        )

    def stage_clusters(self) -> None:
        if self._is_done("clusters"):
            self._load_done("clusters")
            return
        t0 = time.perf_counter()
        c = self._corpus()
        n = len(c)
        with np.load(os.path.join(self.work, "verified.npz")) as z:
            edges, edge_j = z["edges"], z["exact"]
        known = {(a, b): j for (a, b), j in zip(edges.tolist(), edge_j.tolist(), strict=True)}
        uf = UnionFind(n)
        for a, b in edges.tolist():
            uf.union(a, b)
        for d in np.flatnonzero(c.exact_rep != np.arange(n)).tolist():
            uf.union(d, int(c.exact_rep[d]))
        roots = uf.roots()
        best = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(best, roots, c.rank)
        by_rank = np.empty(n, dtype=np.int64)
        by_rank[c.rank] = np.arange(n)
        keeper = by_rank[best[roots]]
        removed = np.flatnonzero(keeper != np.arange(n))
        kind_exact = c.exact_rep[removed] == c.exact_rep[keeper[removed]]
        est = (c.sigs[removed] == c.sigs[keeper[removed]]).mean(axis=1) if len(removed) else np.empty(0)
        exact_j = np.ones(len(removed))
        near = np.flatnonzero(~kind_exact)
        if len(near):
            store = DocStore(*self._store_args())
            try:
                for i in near.tolist():
                    a, b = int(c.exact_rep[removed[i]]), int(c.exact_rep[keeper[removed[i]]])
                    j = known.get((min(a, b), max(a, b)))  # verified directly: reuse; else (transitive) compute
                    exact_j[i] = j if j is not None else store.jaccard(int(removed[i]), int(keeper[removed[i]]))
            finally:
                store.close()
        sizes = np.bincount(roots, minlength=n)
        sizes = sizes[sizes >= 2]
        with atomic_write(os.path.join(self.work, "clusters.npz")) as f:
            np.savez(f, keeper=keeper, removed=removed, kind_exact=kind_exact, estimated=est, exact=exact_j)
        hist: dict[str, int] = {}
        for lo, hi in ((2, 2), (3, 3), (4, 7), (8, 15), (16, 63), (64, None)):
            m = (sizes >= lo) & (sizes <= hi) if hi else sizes >= lo
            if m.any():
                hist[f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi else f"{lo}+")] = int(m.sum())
        self._mark_done(
            "clusters",
            {
                "seconds": time.perf_counter() - t0,
                "clusters": int(len(sizes)),
                "docs_in_clusters": int(sizes.sum()),
                "largest_cluster": int(sizes.max()) if len(sizes) else 0,
                "size_histogram": hist,
                "removed_exact": int(kind_exact.sum()),
                "removed_near": int((~kind_exact).sum()),
            },
        )

    def stage_filter(self) -> None:
        if self._is_done("filter"):
            self._load_done("filter")
            return
        t0 = time.perf_counter()
        c = self._corpus()
        n = len(c)
        with np.load(os.path.join(self.work, "clusters.npz")) as z:
            keeper, removed = z["keeper"], z["removed"]
            kind_exact, est, exact_j = z["kind_exact"], z["estimated"], z["exact"]
        keep = keeper == np.arange(n)
        need_id = np.zeros(n, dtype=bool)
        need_id[removed] = True
        need_id[keeper[removed]] = True
        ids: dict[int, object] = {}
        final = os.path.join(self.work, "final")
        per_file = []
        bar = self.progress(total=n, unit="doc", desc="filter")
        try:
            starts = np.searchsorted(c.file_idx, np.arange(len(self.paths) + 1))
            for fi, path in enumerate(self.paths):
                lo, hi = int(starts[fi]), int(starts[fi + 1])
                offs = c.offsets[lo:hi]
                d = lo
                kept = 0
                with atomic_write(os.path.join(final, self.names[fi]), fsync=True) as out:
                    for off, line in iter_lines(path):
                        if d >= hi or off != offs[d - lo]:
                            continue  # blank line
                        if keep[d]:
                            out.write(line if line.endswith(b"\n") else line + b"\n")
                            kept += 1
                        if need_id[d]:
                            rec = json.loads(line)
                            ids[d] = (
                                rec[self.cfg.id_key]
                                if self.cfg.id_key in rec
                                else f"{self.names[fi]}:{int(c.lines[d])}"
                            )
                        d += 1
                        bar.update(1)
                per_file.append((hi - lo, kept))
            with atomic_write(os.path.join(final, DUPLICATES_NAME), fsync=True) as out:
                for i, d in enumerate(removed.tolist()):
                    k = int(keeper[d])
                    out.write(
                        dumps_line(
                            {
                                "id": ids[d],
                                "source": self.names[int(c.file_idx[d])],
                                "line": int(c.lines[d]),
                                "duplicate_of": ids[k],
                                "duplicate_of_source": self.names[int(c.file_idx[k])],
                                "duplicate_of_line": int(c.lines[k]),
                                "kind": "exact" if kind_exact[i] else "near",
                                "estimated_jaccard": round(float(est[i]), 4),
                                "exact_jaccard": round(float(exact_j[i]), 4),
                            }
                        )
                    )
        finally:
            bar.close()
        rem_file = c.file_idx[removed]
        inputs = []
        for fi in range(len(self.paths)):
            m = rem_file == fi
            inputs.append(
                {
                    "file": self.cfg.inputs[fi],
                    "docs_in": per_file[fi][0],
                    "docs_out": per_file[fi][1],
                    "exact_duplicates_removed": int(np.count_nonzero(kind_exact[m])),
                    "near_duplicates_removed": int(np.count_nonzero(~kind_exact[m])),
                }
            )
        self._mark_done("filter", {"seconds": time.perf_counter() - t0, "inputs": inputs})

    def publish(self) -> dict:
        final = os.path.join(self.work, "final")
        for i, name in enumerate(self.names + [DUPLICATES_NAME]):
            src = os.path.join(final, name)
            if os.path.exists(src):  # absent: already moved by an earlier, interrupted publish
                os.replace(src, os.path.join(self.out, name))
            _maybe_crash(f"publish:{i + 1}")
        report = self.build_report()
        write_json_atomic(os.path.join(self.out, REPORT_NAME), report, fsync=True)
        if not self.cfg.keep_work:
            shutil.rmtree(self.work, ignore_errors=True)
        return report

    def build_report(self) -> dict:
        st = self.stage_stats
        timings = {s: round(st[s]["seconds"], 3) for s in STAGES}
        total = sum(st[s]["seconds"] for s in STAGES)
        docs = st["signatures"]["docs"]
        inputs = st["filter"]["inputs"]
        docs_out = sum(x["docs_out"] for x in inputs)
        return {
            "tool": "mtnlg-dedup",
            "fingerprint": self.fp,
            "settings": {
                **self.cfg.settings(),
                "preset": self.cfg.preset,
                "hash_scheme": hash_scheme_description(self.cfg.scheme, self.cfg.seed, self.cfg.num_perm),
                "priority": self.fp["priority"],
                "workers": self.cfg.workers,
            },
            "banding": {
                "bands": self.cfg.banding.bands,
                "rows_per_band": self.cfg.banding.rows,
                "formula": "P(candidate | J) = 1 - (1 - J^rows)^bands",
                "candidate_probability": self.cfg.banding.probabilities(),
            },
            "inputs": inputs,
            "totals": {
                "docs_in": docs,
                "docs_out": docs_out,
                "exact_duplicates_removed": st["clusters"]["removed_exact"],
                "near_duplicates_removed": st["clusters"]["removed_near"],
                "bytes_in": st["signatures"]["bytes"],
            },
            "clusters": {
                k: st["clusters"][k] for k in ("clusters", "docs_in_clusters", "largest_cluster", "size_histogram")
            },
            "pairs": {
                k: st["verify"][k]
                for k in (
                    "candidate_pairs",
                    "rejected_by_estimate",
                    "jaccard_computed",
                    "skipped_already_connected",
                    "verified_pairs",
                    "rejected_pairs",
                )
            },
            "signature_bytes_per_doc": self.cfg.num_perm * 4,
            "signature_shards": {"total": st["signatures"]["shards"], "reused": st["signatures"]["shards_resumed"]},
            "timings_s": timings,
            "total_s": round(total, 3),
            "docs_per_s": round(docs / total, 1) if total > 0 else None,
            "resumed_stages": self.resumed,
        }

    def run(self) -> dict:
        self.validate()
        done = self.prepare()
        if done is not None:
            return done
        try:
            self.stage_signatures()
            self.stage_buckets()
            self.stage_verify()
            self.stage_clusters()
            self.stage_filter()
        except InputError:
            self.cleanup_after_error()
            raise
        return self.publish()


def run_dedup(cfg: DedupConfig) -> dict:
    """Run (or resume) the whole pipeline; returns the report dict (also written to ``OUT/report.json``)."""
    return DedupRun(cfg).run()


def format_summary(report: dict) -> str:
    t = report["totals"]
    p = report["pairs"]
    s = report["settings"]
    b = report["banding"]
    lines = [
        "mtnlg-dedup " + ("(already complete, nothing to do)" if report.get("already_complete") else "summary"),
        f"  settings   threshold {s['threshold']}  {b['bands']} bands x {b['rows_per_band']} rows"
        f" ({s['num_perm']} perms)"
        f"  shingle {s['shingle']}  scheme {s['scheme']}  seed {s['seed']}",
        "  P(cand)    " + "  ".join(f"J={j}: {v:.3f}" for j, v in b["candidate_probability"].items()),
    ]
    for x in report["inputs"]:
        lines.append(
            f"  {x['file']}: {x['docs_in']} in, {x['docs_out']} out"
            f" (-{x['exact_duplicates_removed']} exact, -{x['near_duplicates_removed']} near)"
        )
    c = report["clusters"]
    lines += [
        f"  total      {t['docs_in']} in, {t['docs_out']} out, removed {t['exact_duplicates_removed']} exact"
        f" + {t['near_duplicates_removed']} near duplicates",
        f"  clusters   {c['clusters']} (docs in clusters {c['docs_in_clusters']}, largest {c['largest_cluster']})",
        f"  pairs      {p['candidate_pairs']} candidates ({p['rejected_by_estimate']} rejected by estimate),"
        f" {p['jaccard_computed']} exact Jaccard computed,"
        f" {p['verified_pairs']} verified, {p['rejected_pairs']} rejected",
        "  time       "
        + "  ".join(f"{k} {v:.2f}s" for k, v in report["timings_s"].items())
        + f"  total {report['total_s']:.2f}s  ({report['docs_per_s']} docs/s)",
    ]
    if report.get("resumed_stages"):
        lines.append("  resumed    " + ", ".join(report["resumed_stages"]))
    return "\n".join(lines)
