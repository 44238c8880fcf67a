"""Decontamination's two passes as stages over shards (line-aligned byte ranges) of the training file::

    count   count/part-<i>.npz     per shard: documents containing each task n-gram, shard-local lines with a hit
    clean   clean/part-<i>.jsonl   per shard: the cleaned records; clean/part-<i>.json: outcomes and hit list

Between them the driver sums the counts (n-grams in >= frequent_threshold documents are ignored) and numbers
lines and documents across shards. Tasks are ``task(ctx, item)`` functions, run by any engine.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np

from mtnlg_lightning.corpora.formats import Format
from mtnlg_lightning.corpora.jsonl import InputError, ShardRecords, atomic_write, iter_lines
from mtnlg_lightning.corpora.readers import parquet_file
from mtnlg_lightning.corpora.records import BAD_REASONS, BadRecord, check_line
from mtnlg_lightning.corpora.stages import ContextStage, StageRunner
from mtnlg_lightning.corpora.staging import CorpusInput
from mtnlg_lightning.corpora.writers import encode_jsonl, jsonl_to_parquet, parquet_codec
from mtnlg_lightning.curation.ngrams import TaskNgrams, clean_text, words_of
from mtnlg_lightning.curation.signatures import Shard


@dataclass(frozen=True)
class DecontamContext:
    work: str
    input: str
    shards: tuple[Shard, ...]
    index: TaskNgrams
    text_key: str
    id_key: str
    window: int
    min_piece: int
    max_splits: int
    frequent_threshold: int
    on_bad_record: str = "error"

    def path(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)


def count_path(ctx: DecontamContext, i: int) -> str:
    return ctx.path("count", f"part-{i:05d}.npz")


def count_shard(ctx: DecontamContext, i: int) -> None:
    """Pass 1 on shard ``i``: how many documents contain each task n-gram; which lines have any hit."""
    path = count_path(ctx, i)
    if os.path.exists(path):
        return
    shard = ctx.shards[i]
    counts: Counter = Counter()
    hit_lines: list[int] = []
    records = ShardRecords(shard, ctx.text_key, ctx.on_bad_record)
    docs = 0
    for _, _, local, text in records:
        docs += 1
        found = {gid for _, gid in ctx.index.hits(words_of(text))}
        if found:
            counts.update(found)
            hit_lines.append(local)
    with atomic_write(path) as f:
        np.savez(
            f,
            gids=np.fromiter(counts.keys(), dtype=np.int64, count=len(counts)),
            counts=np.fromiter(counts.values(), dtype=np.int64, count=len(counts)),
            hit_lines=np.asarray(hit_lines, dtype=np.int64),
            docs=np.asarray([docs], dtype=np.int64),
            lines=np.asarray([records.lines], dtype=np.int64),
            bad=np.asarray([records.bad[r] for r in BAD_REASONS], dtype=np.int64),
        )


class CountStage(ContextStage[DecontamContext]):
    name = "count"

    def run(self, runner: StageRunner) -> dict:
        ctx = self.ctx
        os.makedirs(ctx.path("count"), exist_ok=True)
        sizes = [s.end - s.start for s in ctx.shards]
        items = list(range(len(ctx.shards)))
        for _ in runner.map(self.name, count_shard, items, ctx, total=sum(sizes), unit="B", size=sizes.__getitem__):
            pass
        freq = np.zeros(len(ctx.index), dtype=np.int64)
        docs, lines = [], []
        bad = np.zeros(len(BAD_REASONS), np.int64)
        for i in items:
            with np.load(count_path(ctx, i)) as z:
                np.add.at(freq, z["gids"], z["counts"])
                docs.append(int(z["docs"][0]))
                lines.append(int(z["lines"][0]))
                bad += z["bad"]
        if sum(docs) == 0:
            raise InputError(f"{ctx.input}: empty input (no records)")
        with atomic_write(ctx.path("frequency.npy")) as f:
            np.save(f, freq)
        return {
            "docs": sum(docs),
            "bytes": sum(sizes),
            "docs_per_shard": docs,
            "lines_per_shard": lines,
            "bad_records": dict(zip(BAD_REASONS, bad.tolist(), strict=True)),
        }


def clean_shard(ctx: DecontamContext, job: tuple[int, int, int]) -> dict:
    """Pass 2 on shard ``i``: write the cleaned records; return outcome counts and the documents hit."""
    i, first_line, first_doc = job
    out_path, stats_path = ctx.path("clean", f"part-{i:05d}.jsonl"), ctx.path("clean", f"part-{i:05d}.json")
    if os.path.exists(stats_path):
        with open(stats_path) as f:
            return json.load(f)
    shard = ctx.shards[i]
    active = np.load(ctx.path("frequency.npy")) < ctx.frequent_threshold  # n-grams that are not common phrases
    with np.load(count_path(ctx, i)) as z:
        hit_set = set((z["hit_lines"] + (first_line - 1)).tolist())
    prefix = "-".join(ctx.index.task_names)
    outcome: Counter = Counter()
    hits: list[dict] = []
    doc = first_doc
    with atomic_write(out_path) as out:
        for local, (_, line) in enumerate(iter_lines(shard.path, shard.start, shard.end), start=first_line):
            if not line.strip():
                continue
            try:
                rec, text = check_line(line, ctx.text_key)
            except BadRecord:  # skipped (and counted) by the count pass
                continue
            doc += 1
            if local in hit_set:
                pieces, matched = clean_text(text, ctx.index, active, ctx.window, ctx.min_piece)
            else:
                pieces, matched = [text], []
            if not matched:
                outcome["clean"] += 1
            elif len(pieces) > ctx.max_splits:
                outcome["dropped_too_many_splits"] += 1
            elif not pieces:
                outcome["dropped_no_piece_left"] += 1
            elif len(pieces) == 1:
                outcome["trimmed"] += 1
            else:
                outcome["split"] += 1
            if matched:
                hit = {"file": shard.label, "line": local, "id": rec.get(ctx.id_key), "ngrams": sorted(set(matched))}
                hits.append(hit)
                outcome["matches"] += len(matched)
            if len(pieces) > ctx.max_splits:
                pieces = []
            old = rec.get("split_id")
            use_prefix = f"{old}-" if old is not None else ""
            for k, piece in enumerate(pieces):
                rec[ctx.text_key] = piece
                rec["split_id"] = f"{use_prefix}{prefix}-{doc:010d}-{k:04d}"
                out.write(json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n")
            outcome["pieces_out"] += len(pieces)
            outcome["chars_removed"] += len(text) - sum(len(p) for p in pieces)
    stats = {"outcome": dict(outcome), "hits": hits, "docs": doc - first_doc}
    with atomic_write(stats_path, "w") as f:
        json.dump(stats, f)
    return stats


class CleanStage(ContextStage[DecontamContext]):
    name = "clean"

    def run(self, runner: StageRunner) -> dict:
        count = runner.stats["count"]
        ctx = self.ctx
        os.makedirs(ctx.path("clean"), exist_ok=True)
        # lines are numbered within each input file (reports name file and line); documents across all of them
        first_line, next_line = [], {}
        for shard, lines in zip(ctx.shards, count["lines_per_shard"], strict=True):
            first_line.append(next_line.get(shard.file_idx, 1))
            next_line[shard.file_idx] = first_line[-1] + lines
        first_doc = np.concatenate(([0], np.cumsum(count["docs_per_shard"])[:-1])).tolist()
        jobs = list(zip(range(len(ctx.shards)), first_line, first_doc, strict=True))
        outcome: Counter = Counter()
        hits: list[dict] = []
        docs_by_shard = count["docs_per_shard"]
        for stats in runner.map(
            self.name, clean_shard, jobs, ctx, total=count["docs"], unit="doc", size=lambda j: docs_by_shard[j[0]]
        ):
            outcome.update(stats["outcome"])
            hits += stats["hits"]
        with atomic_write(ctx.path("hits.json"), "w") as f:
            json.dump(hits, f)
        return {"outcome": dict(outcome), "hit_documents": len(hits)}


def concatenate_parts(
    ctx: DecontamContext, output: str, source: CorpusInput, compression: str | None, file_idx: int = 0
) -> None:
    """The output of input ``file_idx``: its shards' cleaned records, in shard order (atomic, fsynced), in the
    input's format (``compression`` overrides a JSON-lines input's): a parquet input gives parquet with its schema
    (plus ``split_id``) and codec."""
    fmt = source.fmt
    plain = output if fmt.kind == "jsonl" and (compression or fmt.compression) == "none" else ctx.path("cleaned.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with atomic_write(plain, fsync=plain == output) as out:
        for i in (i for i, shard in enumerate(ctx.shards) if shard.file_idx == file_idx):
            with open(ctx.path("clean", f"part-{i:05d}.jsonl"), "rb") as f:
                while chunk := f.read(1 << 22):
                    out.write(chunk)
    if plain == output:
        return
    if fmt.kind == "parquet":
        import pyarrow as pa  # optional extra [corpora]: imported on use (a parquet input)

        schema = parquet_file(source.path).schema_arrow
        if "split_id" not in schema.names:
            schema = schema.append(pa.field("split_id", pa.string()))
        jsonl_to_parquet(plain, output, schema, parquet_codec(source.path))
    else:
        encode_jsonl(plain, output, Format(fmt.kind, compression or fmt.compression))
