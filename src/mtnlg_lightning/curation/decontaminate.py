"""A decontamination run: validation, resume-or-start-clean, the two passes on an engine, output and report.

The rules are in :mod:`.ngrams`, the passes in :mod:`.decontaminate_stages`. One input file and ``output``, or
any number of inputs (files, folders, globs) and ``output_dir``: one output per input under its name (a folder's
files keep their paths below it), in the input's format; n-grams are counted over every input together (a common
phrase is common in the whole corpus). Work files live in ``<output dir>/.decontaminate-work-<output name>/``; a
killed run re-run with the same arguments resumes (finished shards of either pass are kept). Every output appears
complete or not at all, then ``report.json``, written last. Outputs named by URLs are made in a local scratch
folder (where a killed run resumes) and committed there at the end (:mod:`mtnlg_lightning.corpora.commit`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.config import fields_from
from mtnlg_lightning.corpora.commit import check_writable, commit, scratch_dir
from mtnlg_lightning.corpora.engine import make_engine
from mtnlg_lightning.corpora.formats import output_name
from mtnlg_lightning.corpora.jsonl import InputError, guard_output, line_starts_plan, shard_size, write_json_atomic
from mtnlg_lightning.corpora.mirror import MIRROR_PREFIX, WorkMirror
from mtnlg_lightning.corpora.records import BadRecordPolicy
from mtnlg_lightning.corpora.sources import expand_inputs
from mtnlg_lightning.corpora.stages import Progress, StageRunner
from mtnlg_lightning.corpora.staging import plain_copies, resolve_inputs
from mtnlg_lightning.curation.decontaminate_stages import CleanStage, CountStage, DecontamContext, concatenate_parts
from mtnlg_lightning.curation.ngrams import load_tasks
from mtnlg_lightning.curation.signatures import Shard

HIT_LIST_LIMIT = 10000
FORMAT_VERSION = 2


@dataclass
class DecontamConfig:
    tasks: list[str]
    input: str | list[str]  # one file (with `output`), or files, folders and globs (with `output_dir`)
    output: str | None = None
    report: str | None = None
    text_key: str = "text"
    id_key: str = "id"
    max_ngram: int = 13
    min_ngram: int = 8
    window: int = 200
    min_piece: int = 200
    max_splits: int = 10
    frequent_threshold: int = 10
    workers: int = 1
    progress: bool = True
    shard_bytes: int = 8 << 20
    engine: str = "local"  # "local" (this machine, `workers` processes) or "ray"
    ray_address: str | None = None  # Ray cluster to join (else RAY_ADDRESS, else a local Ray for the run)
    on_bad_record: str = "error"  # "error" or "skip" (counted by reason in the report)
    output_compression: str | None = None  # None: as the input; "none", "gzip" or "zstd"
    output_dir: str | None = None  # one output per input, under its name (instead of `output`)

    @property
    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)

    def out_dir(self) -> str:
        """The output folder, or URL prefix."""
        if self.output_dir:
            return self.output_dir.rstrip("/") if storage.is_url(self.output_dir) else os.path.abspath(self.output_dir)
        return storage.parent(self.output)

    def report_path(self) -> str:
        return self.report or storage.join(self.out_dir(), "report.json")

    def local_dir(self) -> str:
        """Where the run writes: the output folder, or for a URL a scratch folder its outputs are committed from."""
        out = self.out_dir()
        return scratch_dir(self.output or out) if storage.is_url(out) else out

    def work_dir(self) -> str:
        if self.output_dir:
            return os.path.join(self.local_dir(), ".decontaminate-work")
        return os.path.join(self.local_dir(), f".decontaminate-work-{storage.basename(self.output)}")

    def settings(self) -> dict:
        return {
            k: getattr(self, k)
            for k in (
                "text_key",
                "max_ngram",
                "min_ngram",
                "window",
                "min_piece",
                "max_splits",
                "frequent_threshold",
                "on_bad_record",
                "output_compression",
            )
        }


def _file_stat(path: str) -> dict:
    if storage.is_url(path):
        found = storage.info(path)
        return {"path": path, "size": found.size, "version": found.version}
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _written_at(target: str, local_dir: str, name: str) -> str:
    """The local file a run writes for ``target``: the target itself, or for a URL a file in the scratch folder."""
    return os.path.join(local_dir, name) if storage.is_url(target) else target


class DecontamJob:
    def __init__(self, cfg: DecontamConfig):
        self.cfg = cfg
        self.work = cfg.work_dir()
        self.out_dir = cfg.out_dir()
        self.local_dir = cfg.local_dir()
        self.created_dirs: list[str] = []

    def validate(self) -> None:
        cfg = self.cfg
        BadRecordPolicy(cfg.on_bad_record)  # checks the name
        if (cfg.output is None) == (cfg.output_dir is None):
            raise InputError("name either --output (one input file) or --output-dir (one output per input)")
        for target in (cfg.output or cfg.output_dir, cfg.report):
            if storage.is_url(target):
                check_writable(target)
        self.sources = resolve_inputs(cfg.inputs)
        if cfg.output is not None:
            if len(self.sources) != 1:
                raise InputError(
                    f"--input {' '.join(cfg.inputs)} names {len(self.sources)} files; --output takes one: name "
                    "--output-dir for one output per input"
                )
            self.outputs = [cfg.output]
        else:
            if storage.exists(self.out_dir) and not storage.isdir(self.out_dir):
                raise InputError(f"--output-dir {cfg.output_dir} is a file, expected a directory")
            names = [output_name(f.name, f.fmt, cfg.output_compression) for f in self.sources]
            seen: dict[str, str] = {}
            for source, name in zip(self.sources, names, strict=True):
                if name in seen:
                    raise InputError(
                        f"two inputs have the same file name {name!r} ({seen[name]}, {source.label}); outputs "
                        "would collide"
                    )
                seen[name] = source.label
            self.outputs = [storage.join(self.out_dir, n) for n in names]
        inputs = [f.path for f in self.sources]
        for path in (*self.outputs, cfg.report_path()):
            if storage.isdir(path):
                raise InputError(f"{path} is a directory, expected a file to write")
            guard_output(path, [*inputs, *cfg.tasks])  # an output file is never an input file
        guard_output(cfg.report_path(), self.outputs)

    def prepare(self, engine) -> list[Shard]:
        """Resume a run with the same inputs and settings, else start clean. Returns the shards."""
        cfg = self.cfg
        fp = {
            "format": FORMAT_VERSION,
            "inputs": [_file_stat(f.path) for f in self.sources],
            "tasks": [_file_stat(f.path) for f in expand_inputs(cfg.tasks)],
            **cfg.settings(),
        }
        saved_path = os.path.join(self.work, "config.json")
        plan = None
        if os.path.exists(saved_path):
            try:
                with open(saved_path) as f:
                    saved = json.load(f)
                plan = saved["plan"] if saved.get("fingerprint") == fp else None
            except (OSError, ValueError, KeyError):
                plan = None
        if plan is None:
            shutil.rmtree(self.work, ignore_errors=True)
            d = self.local_dir
            while not os.path.isdir(d):  # remember what we create, to remove it again after bad input
                self.created_dirs.append(d)
                d = os.path.dirname(d)
            os.makedirs(self.work)
        # a compressed, JSON-array or parquet input: a plain JSON-lines copy, line n = record n, every field
        paths = plain_copies(self.sources, os.path.join(self.work, "plain"), engine)
        if plan is None:
            total = sum(os.path.getsize(p) for p in paths)
            size = shard_size(total, cfg.shard_bytes, engine.cpus)
            plan = [line_starts_plan(p, size) for p in paths]
            write_json_atomic(saved_path, {"fingerprint": fp, "plan": plan})
        return [
            Shard(f, i, path, s, e, source.label, source.fmt.kind)
            for f, (path, source, ranges) in enumerate(zip(paths, self.sources, plan, strict=True))
            for i, (s, e) in enumerate(ranges)
        ]

    def mirror(self) -> WorkMirror | None:
        """With an output URL on Ray: the work folder's twin in the store, for workers on other machines."""
        if storage.is_url(self.out_dir) and self.cfg.engine == "ray":
            return WorkMirror(self.local_dir, storage.join(self.out_dir, MIRROR_PREFIX))
        return None

    def cleanup_after_error(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        if self.mirror() is not None:
            storage.remove(self.mirror().remote_root, recursive=True)
        for d in self.created_dirs:  # innermost first
            try:
                os.rmdir(d)
            except OSError:
                break

    def run(self) -> dict:
        cfg = self.cfg
        self.validate()
        t0 = time.perf_counter()
        index = load_tasks(cfg.tasks, cfg.max_ngram, cfg.min_ngram)
        t_tasks = time.perf_counter() - t0
        engine = make_engine(cfg.engine, cfg.workers, cfg.ray_address, self.mirror())
        try:
            try:
                shards = self.prepare(engine)
            except InputError:
                self.cleanup_after_error()
                raise
            # the keys, the removal settings and the bad-record policy from the config's fields of the same name
            ctx = fields_from(
                DecontamContext, cfg, work=self.work, input=", ".join(cfg.inputs), shards=tuple(shards), index=index
            )
            runner = StageRunner(self.work, engine, Progress(cfg.progress))
            try:
                runner.run([CountStage(ctx), CleanStage(ctx)])
            except InputError:
                self.cleanup_after_error()
                raise
        finally:
            engine.close()
        return self.publish(ctx, runner, t_tasks)

    def assemble_outputs(self, ctx: DecontamContext) -> list[str]:
        """Each output from its cleaned parts, where the run writes it (the target itself, or for a URL a file in the
        scratch folder); returns those paths."""
        names = [self._name(output) for output in self.outputs]
        written = [_written_at(o, self.local_dir, n) for o, n in zip(self.outputs, names, strict=True)]
        for f, (output, source) in enumerate(zip(written, self.sources, strict=True)):
            concatenate_parts(ctx, output, source, self.cfg.output_compression, f)
        return written

    def publish(self, ctx: DecontamContext, runner: StageRunner, t_tasks: float) -> dict:
        """The outputs, then the report, which marks the result complete: on disk it is replaced last, for URLs
        it is committed last."""
        report_path = self.cfg.report_path()
        if not storage.is_url(report_path) and os.path.exists(report_path):
            os.unlink(report_path)  # replaced last: the old one never describes the new output
        written = self.assemble_outputs(ctx)
        report = self.build_report(ctx, runner, t_tasks)
        report_written = _written_at(report_path, self.local_dir, ".report.json")
        write_json_atomic(report_written, report, fsync=True)
        remote = [(w, o) for w, o in zip(written, self.outputs, strict=True) if storage.is_url(o)]
        if storage.is_url(report_path):  # the report marks the result complete: removed first, committed last
            remote.append((report_written, report_path))
        commit(remote, markers=1 if storage.is_url(report_path) else 0)
        if report_written != report_path:
            os.unlink(report_written)
        shutil.rmtree(self.work, ignore_errors=True)
        if storage.is_url(self.out_dir):
            shutil.rmtree(self.local_dir, ignore_errors=True)
        if self.mirror() is not None:
            storage.remove(self.mirror().remote_root, recursive=True)
        return report

    def _name(self, output: str) -> str:
        """An output's path below the output folder (its base name with --output)."""
        if self.cfg.output is not None:
            return storage.basename(output)
        return output[len(self.out_dir) :].lstrip("/" + os.sep)

    def build_report(self, ctx: DecontamContext, runner: StageRunner, t_tasks: float) -> dict:
        """`report.json` (or `--report`), written after the outputs are complete:

        tool             "mtnlg-decontaminate"
        settings         input, output(s), tasks, n-gram lengths, window, min_piece, max_splits,
                         frequent_threshold, workers, engine
        tasks            task_texts per task, ngrams (how many), ngrams_by_length
        frequent_ngrams  ignored (n-grams in >= frequent_threshold documents), top: [{ngram, documents, tasks}]
        documents        in, records_out, clean, trimmed, split, dropped_too_many_splits, dropped_no_piece_left,
                         bad_records_skipped, matches_removed, chars_removed
        hits             documents, per_task {documents, matches}, list: [{file, line, id, ngrams: [{ngram,
                         tasks}]}] (the first ones; list_truncated says whether there are more)
        bad_records      skipped records by reason
        input_files, input_format(s), bytes_in
        timings_s        load_tasks, count_pass, clean_pass; mb_per_s, mb_per_s_per_worker
        resumed_stages   the passes a resumed run found finished
        """
        cfg, index = self.cfg, ctx.index
        count, clean = runner.stats["count"], runner.stats["clean"]
        outcome = Counter(clean["outcome"])
        freq = np.load(ctx.path("frequency.npy"))
        with open(ctx.path("hits.json")) as f:
            hits = json.load(f)
        by_len = Counter(len(g) for g in index.ngrams)
        size = count["bytes"]
        t_count, t_clean = count["seconds"], clean["seconds"]
        scan_s = t_count + t_clean
        return {
            "tool": "mtnlg-decontaminate",
            "settings": {
                "input": cfg.input,
                "output": cfg.output,
                "output_dir": cfg.output_dir,
                "outputs": self.outputs,
                "tasks": cfg.tasks,
                **cfg.settings(),
                "workers": cfg.workers,
                "engine": cfg.engine,
            },
            "tasks": {
                "task_texts": dict(index.task_texts),
                "ngrams": len(index),
                "ngrams_by_length": {str(k): v for k, v in sorted(by_len.items())},
            },
            "frequent_ngrams": _frequent_report(index, freq, cfg.frequent_threshold),
            "documents": {
                "in": count["docs"],
                "records_out": outcome["pieces_out"],
                "clean": outcome["clean"],
                "trimmed": outcome["trimmed"],
                "split": outcome["split"],
                "dropped_too_many_splits": outcome["dropped_too_many_splits"],
                "dropped_no_piece_left": outcome["dropped_no_piece_left"],
                "bad_records_skipped": sum(count["bad_records"].values()),
                "matches_removed": outcome["matches"],
                "chars_removed": outcome["chars_removed"],
            },
            "hits": _hits_report(index, hits),
            "bad_records": count["bad_records"],
            "input_files": [f.label for f in self.sources],
            "input_format": str(self.sources[0].fmt) if len(self.sources) == 1 else None,
            "input_formats": [str(f.fmt) for f in self.sources],
            "bytes_in": size,
            "timings_s": {
                "load_tasks": round(t_tasks, 3),
                "count_pass": round(t_count, 3),
                "clean_pass": round(t_clean, 3),
            },
            "resumed_stages": runner.resumed,
            "mb_per_s": round(size / 1e6 / scan_s, 2) if scan_s > 0 else None,
            "mb_per_s_per_worker": round(size / 1e6 / scan_s / max(1, cfg.workers), 2) if scan_s > 0 else None,
        }


def _frequent_report(index, freq: np.ndarray, threshold: int) -> dict:
    """The task n-grams ignored as common phrases (found in >= `threshold` documents), the 20 most frequent named."""
    frequent = np.flatnonzero(freq >= threshold)
    top = frequent[np.argsort(-freq[frequent], kind="stable")][:20]
    return {
        "ignored": int(len(frequent)),
        "top": [
            {"ngram": index.ngram_text(int(g)), "documents": int(freq[g]), "tasks": index.tasks_of(int(g))} for g in top
        ],
    }


def _hits_report(index, hits: list[dict]) -> dict:
    """The documents a task n-gram was found in: their number, per task (documents and matches), and the first
    HIT_LIST_LIMIT of them with their n-grams."""
    per_task_docs: Counter = Counter()
    per_task_matches: Counter = Counter()
    for h in hits:
        tasks_hit = set()
        for gid in h["ngrams"]:
            for t in index.tasks_of(gid):
                per_task_matches[t] += 1
                tasks_hit.add(t)
        per_task_docs.update(tasks_hit)
    hit_list = [
        {
            "file": h["file"],
            "line": h["line"],
            "id": h["id"],
            "ngrams": [{"ngram": index.ngram_text(g), "tasks": index.tasks_of(g)} for g in h["ngrams"]],
        }
        for h in hits[:HIT_LIST_LIMIT]
    ]
    return {
        "documents": len(hits),
        "per_task": {t: {"documents": per_task_docs[t], "matches": per_task_matches[t]} for t in index.task_names},
        "list": hit_list,
        "list_truncated": len(hits) > len(hit_list),
    }


def run_decontaminate(cfg: DecontamConfig) -> dict:
    """Run (or resume) both passes; returns the report (also written to ``cfg.report_path()``)."""
    return DecontamJob(cfg).run()
