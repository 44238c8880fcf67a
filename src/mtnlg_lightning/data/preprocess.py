"""Corpora -> tokenized PREFIX.bin/.idx (each document followed by the end-of-document token).

Inputs are anything the reader layer takes (:mod:`mtnlg_lightning.corpora`: files, folders, globs; JSON lines
plain/gzip/zstd, JSON arrays, parquet). The work is split into read tasks: a compressed or parquet file is one
task, a plain JSON-lines file is split into byte ranges at line starts (``range_bytes``), so that one large file
keeps every worker busy. With several workers each task writes its own part dataset and the parts are merged in
task order, so the output is byte-identical whatever the number of workers; memory holds a batch of texts per
worker, never a file. Inputs, the tokenizer and the output prefix may be URLs: inputs stream in ranged requests,
an output URL is written locally and committed when complete (the ``.idx`` last).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from tqdm import tqdm

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.corpora.commit import output_files
from mtnlg_lightning.corpora.formats import CorpusError, Format, detect
from mtnlg_lightning.corpora.jsonl import count_lines_before, iter_lines, line_starts_plan
from mtnlg_lightning.corpora.readers import batched, iter_records
from mtnlg_lightning.corpora.records import (
    BAD_REASONS,
    SKIP_HINT,
    BadRecord,
    BadRecordPolicy,
    check_line,
    format_bad,
    locate,
)
from mtnlg_lightning.corpora.sources import InputFile, expand_inputs
from mtnlg_lightning.data.indexed import DATASET_SUFFIXES, IndexedDataset, IndexedDatasetWriter, best_dtype
from mtnlg_lightning.data.tokenizer import Tokenizer, local_tokenizer
from mtnlg_lightning.errors import MTNLGError

RANGE_BYTES = 64 << 20
BATCH = 256

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str, single_thread: bool = False) -> None:
    global _worker_tokenizer
    if single_thread:  # one of several worker processes: the cores are shared out by process, not by thread
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = Tokenizer(tokenizer_path)


@dataclass(frozen=True)
class ReadTask:
    file: InputFile
    fmt: Format
    start: int = 0
    end: int | None = None  # a byte range of a plain JSON-lines file; None: the whole file

    @property
    def size(self) -> int:
        return (self.end - self.start) if self.end is not None else storage.getsize(self.file.path)


def plan_read_tasks(inputs: list[str], range_bytes: int = RANGE_BYTES) -> list[ReadTask]:
    """Files (formats checked before any work starts) to read tasks, in corpus order."""
    tasks = []
    for f in expand_inputs(inputs):
        fmt = detect(f.path)
        if fmt.plain_jsonl and storage.getsize(f.path) > range_bytes:
            tasks += [ReadTask(f, fmt, s, e) for s, e in line_starts_plan(f.path, range_bytes)]
        else:
            tasks.append(ReadTask(f, fmt))
    return tasks


def _range_texts(task: ReadTask, text_key: str, policy: BadRecordPolicy) -> Iterator[str]:
    path = task.file.path
    for local, (_, line) in enumerate(iter_lines(path, task.start, task.end), start=1):
        if not line.strip():
            continue
        try:
            yield check_line(line, text_key)[1]
        except BadRecord as err:
            if policy.mode == "error":
                where = locate(path, "jsonl", count_lines_before(path, task.start) + local)
                raise CorpusError(f"{where}: {err}{SKIP_HINT}") from None
            policy.bad(err, "")


def task_texts(task: ReadTask, text_key: str, policy: BadRecordPolicy, batch: int = BATCH) -> Iterator[list[str]]:
    """The good texts of one read task, in batches."""
    if task.end is not None:
        texts: Iterator[str] = _range_texts(task, text_key, policy)
    else:
        texts = (r.text for r in iter_records([task.file], text_key, None, policy, {task.file.path: task.fmt}))
    yield from batched(texts, batch)


def _encode_into(writer: IndexedDatasetWriter, task: ReadTask, text_key: str, policy: BadRecordPolicy) -> tuple:
    tok = _worker_tokenizer
    eod = tok.eod_id
    docs = tokens = 0
    for texts in task_texts(task, text_key, policy):
        for ids in tok.encode_batch(texts):
            ids.append(eod)
            writer.add_document(ids)
            tokens += len(ids)
        docs += len(texts)
    return docs, tokens


def _encode_part(job: tuple) -> tuple[int, int, dict]:
    """A worker's task: one read task to its own part dataset ``part_prefix``."""
    task, text_key, on_bad_record, part_prefix, dtype = job
    policy = BadRecordPolicy(on_bad_record)
    writer = IndexedDatasetWriter(part_prefix, dtype)
    try:
        docs, tokens = _encode_into(writer, task, text_key, policy)
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    return docs, tokens, dict(policy.counts)


@dataclass
class PreprocessSummary:
    documents: int
    tokens: int
    input_bytes: int
    seconds: float
    bad_records: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        rate = self.input_bytes / 1e6 / max(self.seconds, 1e-9)
        text = (
            f"{self.documents:,} documents, {self.tokens:,} tokens (EOD included) in {self.seconds:.1f} s: "
            f"{self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s, {rate:.2f} MB/s"
        )
        if sum(self.bad_records.values()):
            text += f"; {format_bad(self.bad_records)}"
        return text


def preprocess(
    inputs: list[str] | str,
    tokenizer_path: str,
    output_prefix: str,
    json_key: str = "text",
    workers: int = 1,
    progress: bool = True,
    on_bad_record: str = "error",
    range_bytes: int = RANGE_BYTES,
) -> PreprocessSummary:
    """Tokenize ``inputs`` (files, folders, globs) into ``output_prefix``.bin/.idx, atomically (a URL: written
    locally, committed there when complete)."""
    with output_files(output_prefix, DATASET_SUFFIXES) as local_prefix:
        return _preprocess(
            inputs, tokenizer_path, local_prefix, json_key, workers, progress, on_bad_record, range_bytes
        )


def _preprocess(inputs, tokenizer_path, output_prefix, json_key, workers, progress, on_bad_record, range_bytes):
    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    start = time.perf_counter()
    policy = BadRecordPolicy(on_bad_record)
    tasks = plan_read_tasks(inputs, range_bytes)
    tokenizer_path = local_tokenizer(tokenizer_path)  # fetched once, not by every worker
    tokenizer = Tokenizer(tokenizer_path)
    dtype = best_dtype(tokenizer.vocab_size)
    input_bytes = sum(t.size for t in tasks)
    documents = tokens = 0
    bar = tqdm(total=input_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress)
    writer = IndexedDatasetWriter(output_prefix, dtype)
    parts_dir = None
    try:
        if workers <= 1 or len(tasks) == 1:
            _init_worker(tokenizer_path)
            for task in tasks:
                d, t = _encode_into(writer, task, json_key, policy)
                documents, tokens = documents + d, tokens + t
                bar.update(task.size)
        else:
            out_dir = os.path.dirname(os.path.abspath(output_prefix))
            os.makedirs(out_dir, exist_ok=True)
            parts_dir = tempfile.mkdtemp(prefix=".preprocess-parts-", dir=out_dir)
            parts = [os.path.join(parts_dir, f"{i:06d}") for i in range(len(tasks))]
            jobs = [(t, json_key, on_bad_record, part, dtype) for t, part in zip(tasks, parts, strict=True)]
            with mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer_path, True)) as pool:
                for task, part, (d, t, bad) in zip(tasks, parts, pool.imap(_encode_part, jobs), strict=True):
                    writer.append_raw(IndexedDataset(part))  # parts in task order: the same bytes as one worker
                    for suffix in (".bin", ".idx"):
                        os.unlink(part + suffix)
                    documents, tokens = documents + d, tokens + t
                    policy.counts.update(Counter(bad))
                    bar.update(task.size)
        if documents == 0:
            raise MTNLGError(f"{', '.join(inputs)} holds no documents")
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        if parts_dir is not None:
            shutil.rmtree(parts_dir, ignore_errors=True)
    summary = PreprocessSummary(documents, tokens, input_bytes, time.perf_counter() - start, policy.summary())
    return summary


def preprocess_jsonl(input_path: str, tokenizer_path: str, output_prefix: str, json_key: str = "text", **kw):
    """One input (kept for callers of the JSONL-only version)."""
    return preprocess([input_path], tokenizer_path, output_prefix, json_key, **kw)


def read_texts(inputs: list[str] | str, json_key: str, on_bad_record: str = "error") -> tuple[list[str], dict]:
    """Every good text of ``inputs`` in memory (tokenizer training) and the bad-record counts."""
    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    policy = BadRecordPolicy(on_bad_record)
    texts = [t for task in plan_read_tasks(inputs) for chunk in task_texts(task, json_key, policy) for t in chunk]
    return texts, policy.summary()


__all__ = ["BAD_REASONS", "PreprocessSummary", "preprocess", "preprocess_jsonl", "read_texts"]
