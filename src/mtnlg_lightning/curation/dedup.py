"""Fuzzy document deduplication: exact-duplicate removal, MinHash LSH with explicit banding, exact-Jaccard
verification, union-find clusters, priority keep.

This module owns a run: validation, resume-or-start-clean, the engine, publishing the outputs and the report.
The stages and their tasks are in :mod:`.dedup_stages`; the runner (done markers, timing) in :mod:`.stages`.
Every file is written atomically, so a killed run re-run with the same output directory resumes at the first
unfinished stage (finished tasks kept); a run with different inputs or settings starts clean. ``report.json``
is written last: an output directory without it is never a finished result.

An output URL (``s3://bucket/dedup/``) is written the same way: the run works in a local scratch folder (where a
killed run resumes) and commits its outputs there at the end (:mod:`mtnlg_lightning.corpora.commit`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.corpora.commit import check_writable, commit, scratch_dir
from mtnlg_lightning.corpora.engine import make_engine
from mtnlg_lightning.corpora.formats import output_name
from mtnlg_lightning.corpora.jsonl import InputError, guard_output, line_starts_plan, shard_size, write_json_atomic
from mtnlg_lightning.corpora.mirror import MIRROR_PREFIX, WorkMirror
from mtnlg_lightning.corpora.records import BadRecordPolicy
from mtnlg_lightning.corpora.stages import Progress, StageRunner
from mtnlg_lightning.corpora.staging import plain_copies, resolve_inputs
from mtnlg_lightning.curation.dedup_stages import DUPLICATES_NAME, DedupContext, dedup_stages
from mtnlg_lightning.curation.lsh import DEFAULT_BANDING, DEFAULT_MAX_NEIGHBORS, Banding
from mtnlg_lightning.curation.shingles import ShingleSpec
from mtnlg_lightning.curation.signatures import Shard, SignatureSettings

WORK_DIR_NAME = ".dedup-work"
STAGES = ("signatures", "buckets", "verify", "clusters", "filter")
REPORT_NAME = "report.json"
FORMAT_VERSION = 4


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
    engine: str = "local"  # "local" (this machine, `workers` processes) or "ray"
    ray_address: str | None = None  # Ray cluster to join (else RAY_ADDRESS, else a local Ray for the run)
    on_bad_record: str = "error"  # "error" or "skip" (counted by reason in the report)
    output_compression: str | None = None  # None: each output as its input; "none", "gzip" or "zstd"

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
            "on_bad_record": self.on_bad_record,
            "output_compression": self.output_compression,
        }


class DedupJob:
    """One dedup run over an output directory: decides resume / start clean / already complete, runs the
    stages on an engine, publishes the outputs and writes the report last."""

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg
        self.out = cfg.output_dir
        self.remote = storage.is_url(self.out)
        # where the run writes: the output folder, or for a URL a scratch folder its outputs are committed from
        self.local_out = scratch_dir(self.out) if self.remote else self.out
        self.work = os.path.join(self.local_out, WORK_DIR_NAME)
        self.created_out = False

    # -- setup / validation ------------------------------------------------------------------------------
    def validate(self) -> None:
        cfg = self.cfg
        if not cfg.inputs:
            raise InputError("no input files given")
        BadRecordPolicy(cfg.on_bad_record)  # checks the name
        self.files = resolve_inputs(cfg.inputs)
        self.labels = [f.label for f in self.files]
        self.paths = [f.path for f in self.files]
        self.names = [f.name for f in self.files]  # in reports
        self.out_names = [output_name(f.name, f.fmt, cfg.output_compression) for f in self.files]
        seen: dict[str, str] = {}
        for p, name in zip(self.labels, self.out_names, strict=True):
            if name in seen:
                raise InputError(
                    f"two inputs have the same file name {name!r} ({seen[name]}, {p}); outputs would collide"
                )
            if name in (DUPLICATES_NAME, REPORT_NAME):
                raise InputError(f"{p}: input file name {name!r} collides with an output file name")
            seen[name] = p
        if self.remote:
            check_writable(self.out)
        if storage.exists(self.out) and not storage.isdir(self.out):
            raise InputError(f"--output-dir {self.out} is a file, expected a directory")
        for output in self.output_files() + [storage.join(self.out, REPORT_NAME)]:
            guard_output(output, self.paths)  # an output file is never an input file
        if not 0.0 < cfg.threshold <= 1.0:
            raise InputError(f"--threshold must be in (0, 1], got {cfg.threshold}")
        self.file_rank = self._file_rank()

    def _file_rank(self) -> list[int]:
        order: list[int] = []
        for item in self.cfg.priority or []:
            matches = [
                i
                for i, p in enumerate(self.labels)
                if item == p or os.path.abspath(item) == self.paths[i] or item == self.names[i]
            ]
            if not matches:
                raise InputError(f"--priority names {item!r}, which is not one of the inputs")
            if matches[0] not in order:
                order.append(matches[0])
        order += [i for i in range(len(self.files)) if i not in order]
        rank = [0] * len(order)
        for r, i in enumerate(order):
            rank[i] = r
        return rank

    def fingerprint(self) -> dict:
        files = []
        for p in self.paths:
            if storage.is_url(p):
                found = storage.info(p)
                files.append({"path": p, "size": found.size, "version": found.version})
            else:
                st = os.stat(p)
                files.append({"path": p, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        return {
            "format": FORMAT_VERSION,
            "inputs": files,
            "priority": [self.names[i] for i in sorted(range(len(self.names)), key=lambda i: self.file_rank[i])],
            **self.cfg.settings(),
        }

    def output_files(self) -> list[str]:
        return [storage.join(self.out, n) for n in self.out_names + [DUPLICATES_NAME]]

    def _finished_report(self) -> dict | None:
        """The report of a finished run in the output folder, if there is one and every output it names is there."""
        report_path = storage.join(self.out, REPORT_NAME)
        if not storage.exists(report_path):
            return None
        try:
            report = json.loads(storage.read_bytes(report_path))
        except (OSError, ValueError):
            return None
        if report.get("fingerprint") != self.fp or not all(storage.exists(p) for p in self.output_files()):
            return None
        return report

    def prepare(self, engine) -> dict | None:
        """Decide between 'already complete', 'resume' and 'start clean'. Returns the report if complete."""
        fp = self.fingerprint()
        self.fp = fp
        if not os.path.isdir(self.local_out):
            os.makedirs(self.local_out)
            self.created_out = True
        work_cfg = os.path.join(self.work, "config.json")
        if not self.cfg.force and not os.path.exists(self.work):
            report = self._finished_report()
            if report is not None:
                report["already_complete"] = True
                return report
        resume = False
        if os.path.exists(self.work):
            try:
                with open(work_cfg) as f:
                    saved = json.load(f)
                resume = not self.cfg.force and saved.get("fingerprint") == fp
            except (OSError, ValueError):
                resume = False
            if resume:
                plan = saved["plan"]
            else:
                shutil.rmtree(self.work)
        # The previous outputs and report stay as they were until `publish` replaces them (a run that fails on
        # bad input, or is killed, loses nothing); the work folder marks the run as not complete meanwhile.
        # Compressed, JSON-array and parquet inputs: a plain JSON-lines copy, line n = record n (text and id
        # only for parquet: its output is the input's own rows).
        columns = [self.cfg.text_key, self.cfg.id_key]
        self.plain = plain_copies(self.files, os.path.join(self.work, "plain"), engine, columns)
        if not resume:
            os.makedirs(os.path.join(self.work, "sig"))
            plan = []
            # ~16 shards per CPU: the signature stage (most of the run) ends with every worker busy until
            # about the same time; a shard costs a few milliseconds of overhead
            total = sum(os.path.getsize(p) for p in self.plain)
            size = shard_size(total, self.cfg.shard_bytes, engine.cpus, per_cpu=16)
            for fi, p in enumerate(self.plain):
                for si, (s, e) in enumerate(line_starts_plan(p, size)):
                    plan.append((fi, si, s, e))
            write_json_atomic(work_cfg, {"fingerprint": fp, "plan": plan})
        self.shards = [
            Shard(fi, si, self.plain[fi], s, e, self.labels[fi], self.files[fi].fmt.kind) for fi, si, s, e in plan
        ]
        return None

    def context(self) -> DedupContext:
        cfg = self.cfg
        return DedupContext(
            work=self.work,
            inputs=tuple(self.plain),
            names=tuple(self.names),
            out_names=tuple(self.out_names),
            sources=tuple(self.paths),
            formats=tuple(f.fmt for f in self.files),
            output_compression=cfg.output_compression,
            shards=tuple(self.shards),
            file_rank=tuple(self.file_rank),
            signature=SignatureSettings(
                cfg.text_key, str(cfg.shingle), cfg.num_perm, cfg.seed, cfg.scheme, cfg.on_bad_record
            ),
            id_key=cfg.id_key,
            banding=cfg.banding,
            max_neighbors=cfg.max_neighbors,
            threshold=cfg.threshold,
            estimate_margin=cfg.estimate_margin,
        )

    def mirror(self) -> WorkMirror | None:
        """With an output URL on Ray: the work folder's twin in the store, for workers on other machines."""
        if self.remote and self.cfg.engine == "ray":
            return WorkMirror(self.local_out, storage.join(self.out, MIRROR_PREFIX))
        return None

    def cleanup_after_error(self) -> None:
        """Bad input: leave nothing of this run behind (its work folder, the output folder if it made it, the work
        folder's twin in the store); the previous outputs, if any, are untouched."""
        shutil.rmtree(self.work, ignore_errors=True)
        if self.mirror() is not None:
            storage.remove(self.mirror().remote_root, recursive=True)
        if self.created_out:
            try:
                os.rmdir(self.local_out)
            except OSError:
                pass

    def publish(self, runner: StageRunner) -> dict:
        if self.remote:
            return self.commit(runner)
        final = os.path.join(self.work, "final")
        report_path = os.path.join(self.out, REPORT_NAME)
        if os.path.exists(report_path):  # the old report must not describe a mix of old and new outputs
            os.unlink(report_path)
        for name in self.out_names + [DUPLICATES_NAME]:
            self.move_output(final, name)
        report = self.build_report(runner)
        write_json_atomic(os.path.join(self.out, REPORT_NAME), report, fsync=True)
        if not self.cfg.keep_work:
            shutil.rmtree(self.work, ignore_errors=True)
        return report

    def move_output(self, final: str, name: str) -> None:
        """One output from the work folder into OUT (one step of the publish)."""
        src = os.path.join(final, name)
        if os.path.exists(src):  # absent: already moved by an earlier, interrupted publish
            dest = os.path.join(self.out, name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.replace(src, dest)

    def commit(self, runner: StageRunner) -> dict:
        """Outputs, duplicates.jsonl and the report (last) from the scratch folder to the output URL; the previous
        result there stays whole until the final copies."""
        final = os.path.join(self.work, "final")
        report = self.build_report(runner)
        write_json_atomic(os.path.join(final, REPORT_NAME), report)
        names = self.out_names + [DUPLICATES_NAME, REPORT_NAME]
        commit([(os.path.join(final, n), storage.join(self.out, n)) for n in names])
        if not self.cfg.keep_work:
            shutil.rmtree(self.local_out, ignore_errors=True)
            if self.mirror() is not None:
                storage.remove(self.mirror().remote_root, recursive=True)
        return report

    def build_report(self, runner: StageRunner) -> dict:
        """`OUT/report.json`, written last (its presence means the run is complete):

        tool             "mtnlg-dedup"
        fingerprint      the inputs (paths, sizes, modification times) and settings a resume must match
        settings         every setting of the run (shingles, threshold, permutations, seed, priority, engine, ...)
        banding          bands, rows_per_band, the formula and the candidate probability at several Jaccards
        inputs           per input file: file, format, output, docs_in, docs_out
        totals           docs_in, docs_out, exact_duplicates_removed, near_duplicates_removed, bytes_in,
                         bad_records_skipped
        bad_records      skipped records by reason
        clusters         clusters, docs_in_clusters, largest_cluster, size_histogram
        pairs            candidate_pairs, rejected_by_estimate, jaccard_computed, skipped_already_connected,
                         verified_pairs, rejected_pairs
        signature_bytes_per_doc, signature_shards {total, reused}
        timings_s        seconds per stage; total_s, docs_per_s
        resumed_stages   the stages a resumed run found finished

        Beside it: the deduplicated files (one per input, its name) and `duplicates.jsonl` (one line per removed
        document: the removed document, the kept one of its cluster, the MinHash estimate and the exact Jaccard).
        """
        st = runner.stats
        timings = {s: round(st[s]["seconds"], 3) for s in STAGES}
        total = sum(st[s]["seconds"] for s in STAGES)
        docs = st["signatures"]["docs"]
        inputs = [
            {"file": f, "format": str(inp.fmt), "output": o, **x}
            for f, inp, o, x in zip(self.labels, self.files, self.out_names, st["filter"]["inputs"], strict=True)
        ]
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
                "engine": self.cfg.engine,
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
                "bad_records_skipped": sum(st["signatures"]["bad_records"].values()),
            },
            "bad_records": st["signatures"]["bad_records"],
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
            "resumed_stages": runner.resumed,
        }

    def run(self) -> dict:
        self.validate()
        # before touching OUT
        engine = make_engine(self.cfg.engine, self.cfg.workers, self.cfg.ray_address, self.mirror())
        try:
            runner = StageRunner(self.work, engine, Progress(self.cfg.progress))
            try:
                done = self.prepare(engine)
                if done is not None:
                    return done
                runner.run(dedup_stages(self.context()))
            except InputError:
                self.cleanup_after_error()
                raise
        finally:
            engine.close()
        return self.publish(runner)


def run_dedup(cfg: DedupConfig) -> dict:
    """Run (or resume) the whole pipeline; returns the report dict (also written to ``OUT/report.json``)."""
    return DedupJob(cfg).run()
