"""JSONL -> tokenized PREFIX.bin/.idx (each document followed by the end-of-document token)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass

from tqdm import tqdm

from mtnlg_lightning.data.indexed import IndexedDatasetWriter, best_dtype
from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.errors import MTNLGError

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(tokenizer_path)


def _encode_chunk(chunk: tuple[list[str], int]) -> tuple[list[list[int]], int]:
    texts, num_bytes = chunk
    eod = _worker_tokenizer.eod_id
    return [ids + [eod] for ids in _worker_tokenizer.encode_batch(texts)], num_bytes


def read_texts(path: str, json_key: str, chunk_size: int = 256):
    """Yield (texts, bytes read) chunks from a JSONL file; a bad line raises a one-line error with its number."""
    if not os.path.exists(path):
        raise MTNLGError(f"input file {path} does not exist")
    chunk: list[str] = []
    num_bytes = 0
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, 1):
            num_bytes += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise MTNLGError(f"{path}:{line_number}: not valid UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise MTNLGError(f"{path}:{line_number}: invalid JSON ({error.msg})") from None
            if not isinstance(record, dict) or json_key not in record:
                raise MTNLGError(f"{path}:{line_number}: no {json_key!r} key (choose it with --json-key)")
            chunk.append(str(record[json_key]))
            if len(chunk) == chunk_size:
                yield chunk, num_bytes
                chunk, num_bytes = [], 0
    if chunk:
        yield chunk, num_bytes


@dataclass
class PreprocessSummary:
    documents: int
    tokens: int
    input_bytes: int
    seconds: float

    def __str__(self) -> str:
        rate = self.input_bytes / 1e6 / max(self.seconds, 1e-9)
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens (EOD included) in {self.seconds:.1f} s: "
            f"{self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s, {rate:.2f} MB/s"
        )


def preprocess_jsonl(
    input_path: str,
    tokenizer_path: str,
    output_prefix: str,
    json_key: str = "text",
    workers: int = 1,
    progress: bool = True,
) -> PreprocessSummary:
    tokenizer = Tokenizer(tokenizer_path)
    start = time.perf_counter()
    if not os.path.exists(input_path):
        raise MTNLGError(f"input file {input_path} does not exist")
    input_bytes = os.path.getsize(input_path)
    writer = IndexedDatasetWriter(output_prefix, best_dtype(tokenizer.vocab_size))
    documents = tokens = 0
    pool = mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer_path,)) if workers > 1 else None
    try:
        if pool is None:
            _init_worker(tokenizer_path)
            encoded = map(_encode_chunk, read_texts(input_path, json_key))
        else:
            encoded = pool.imap(_encode_chunk, read_texts(input_path, json_key))
        with tqdm(total=input_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress) as bar:
            for chunk, num_bytes in encoded:
                for ids in chunk:
                    writer.add_document(ids)
                    tokens += len(ids)
                documents += len(chunk)
                bar.update(num_bytes)
                bar.set_postfix(docs=documents, tokens=tokens, refresh=False)
        if documents == 0:
            raise MTNLGError(f"{input_path} holds no documents")
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
    return PreprocessSummary(documents, tokens, input_bytes, time.perf_counter() - start)
