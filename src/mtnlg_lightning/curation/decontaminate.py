"""A decontamination run: validation, resume-or-start-clean, the two passes on an engine, output and report.

The rules are in :mod:`.ngrams`, the passes in :mod:`.decontaminate_stages`. One input file and ``output``, or
any number of inputs (files, folders, globs) and ``output_dir``: one output per input under its name (a folder's
files keep their paths below it), in the input's format; n-grams are counted over every input together (a common
phrase is common in the whole corpus). Work files live in ``<output dir>/.decontaminate-work-<output name>/``; a
killed run re-run with the same arguments resumes (finished shards of either pass are kept). Every output appears
complete or not at all, then ``report.json``, written last.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from mtnlg_lightning.corpora.engine import make_engine
from mtnlg_lightning.corpora.formats import output_name
from mtnlg_lightning.corpora.jsonl import InputError, guard_output, line_starts_plan, shard_size, write_json_atomic
from mtnlg_lightning.corpora.records import BadRecordPolicy, format_bad
from mtnlg_lightning.corpora.sources import expand_inputs
from mtnlg_lightning.corpora.stages import Progress, StageHooks, StageRunner
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
        return os.path.abspath(self.output_dir) if self.output_dir else os.path.dirname(os.path.abspath(self.output))

    def report_path(self) -> str:
        return self.report or os.path.join(self.out_dir(), "report.json")

    def work_dir(self) -> str:
        if self.output_dir:
            return os.path.join(self.out_dir(), ".decontaminate-work")
        out = os.path.abspath(self.output)
        return os.path.join(os.path.dirname(out), f".decontaminate-work-{os.path.basename(out)}")

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
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


class DecontamJob:
    def __init__(self, cfg: DecontamConfig, hooks: StageHooks | None = None):
        self.cfg = cfg
        self.hooks = hooks or StageHooks()
        self.work = cfg.work_dir()
        self.out_dir = cfg.out_dir()
        self.created_dirs: list[str] = []

    def validate(self) -> None:
        cfg = self.cfg
        BadRecordPolicy(cfg.on_bad_record)  # checks the name
        if (cfg.output is None) == (cfg.output_dir is None):
            raise InputError("name either --output (one input file) or --output-dir (one output per input)")
        self.sources = resolve_inputs(cfg.inputs)
        if cfg.output is not None:
            if len(self.sources) != 1:
                raise InputError(
                    f"--input {' '.join(cfg.inputs)} names {len(self.sources)} files; --output takes one: name "
                    "--output-dir for one output per input"
                )
            self.outputs = [cfg.output]
        else:
            if os.path.exists(self.out_dir) and not os.path.isdir(self.out_dir):
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
            self.outputs = [os.path.join(self.out_dir, n) for n in names]
        inputs = [f.path for f in self.sources]
        for path in (*self.outputs, cfg.report_path()):
            if os.path.isdir(path):
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
            d = self.out_dir
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

    def cleanup_after_error(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
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
        engine = make_engine(cfg.engine, cfg.workers, cfg.ray_address)
        try:
            try:
                shards = self.prepare(engine)
            except InputError:
                self.cleanup_after_error()
                raise
            ctx = DecontamContext(
                work=self.work,
                input=", ".join(cfg.inputs),
                shards=tuple(shards),
                index=index,
                text_key=cfg.text_key,
                id_key=cfg.id_key,
                window=cfg.window,
                min_piece=cfg.min_piece,
                max_splits=cfg.max_splits,
                frequent_threshold=cfg.frequent_threshold,
                on_bad_record=cfg.on_bad_record,
            )
            runner = StageRunner(self.work, engine, Progress(cfg.progress), self.hooks)
            try:
                runner.run([CountStage(ctx), CleanStage(ctx)])
            except InputError:
                self.cleanup_after_error()
                raise
        finally:
            engine.close()
        if os.path.exists(cfg.report_path()):  # replaced last: the old one never describes the new output
            os.unlink(cfg.report_path())
        for f, (output, source) in enumerate(zip(self.outputs, self.sources, strict=True)):
            concatenate_parts(ctx, output, source, cfg.output_compression, f)
        self.hooks.point("publish:1")
        report = self.build_report(ctx, runner, t_tasks)
        write_json_atomic(cfg.report_path(), report, fsync=True)
        shutil.rmtree(self.work, ignore_errors=True)
        return report

    def build_report(self, ctx: DecontamContext, runner: StageRunner, t_tasks: float) -> dict:
        cfg, index = self.cfg, ctx.index
        count, clean = runner.stats["count"], runner.stats["clean"]
        outcome = Counter(clean["outcome"])
        freq = np.load(ctx.path("frequency.npy"))
        with open(ctx.path("hits.json")) as f:
            hits = json.load(f)
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
        by_len = Counter(len(g) for g in index.ngrams)
        frequent = np.flatnonzero(freq >= cfg.frequent_threshold)
        top = frequent[np.argsort(-freq[frequent], kind="stable")][:20]
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
            "frequent_ngrams": {
                "ignored": int(len(frequent)),
                "top": [
                    {"ngram": index.ngram_text(int(g)), "documents": int(freq[g]), "tasks": index.tasks_of(int(g))}
                    for g in top
                ],
            },
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
            "hits": {
                "documents": len(hits),
                "per_task": {
                    t: {"documents": per_task_docs[t], "matches": per_task_matches[t]} for t in index.task_names
                },
                "list": hit_list,
                "list_truncated": len(hits) > len(hit_list),
            },
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


def run_decontaminate(cfg: DecontamConfig, hooks: StageHooks | None = None) -> dict:
    """Run (or resume) both passes; returns the report (also written to ``cfg.report_path()``)."""
    return DecontamJob(cfg, hooks).run()


def format_summary(report: dict) -> str:
    d = report["documents"]
    s = report["settings"]
    t = report["tasks"]
    lines = [
        "mtnlg-decontaminate summary",
        f"  tasks      {sum(t['task_texts'].values())} texts from {len(t['task_texts'])} tasks -> {t['ngrams']} n-grams"
        f" (by length {t['ngrams_by_length']})",
        f"  frequent   {report['frequent_ngrams']['ignored']} n-grams in >= {s['frequent_threshold']}"
        " documents ignored",
        f"  documents  {d['in']} in -> {d['records_out']} records out: {d['clean']} clean, {d['trimmed']} trimmed,"
        f" {d['split']} split, {d['dropped_too_many_splits']} dropped (> {s['max_splits']} pieces),"
        f" {d['dropped_no_piece_left']} dropped (no piece > {s['min_piece']} chars)",
        f"  removed    {d['matches_removed']} matches, {d['chars_removed']} chars",
    ]
    if d.get("bad_records_skipped"):
        lines.append(f"  bad        {format_bad(report['bad_records'])}")
    per = report["hits"]["per_task"]
    if per:
        lines.append("  per task   " + ", ".join(f"{k}: {v['documents']} docs" for k, v in per.items()))
    tm = report["timings_s"]
    lines.append(
        f"  time       tasks {tm['load_tasks']:.2f}s  count {tm['count_pass']:.2f}s  clean {tm['clean_pass']:.2f}s"
        f"  -> {report['mb_per_s']} MB/s ({report['mb_per_s_per_worker']} MB/s per worker)"
    )
    if report.get("resumed_stages"):
        lines.append("  resumed    " + ", ".join(report["resumed_stages"]))
    return "\n".join(lines)
