"""Megatron's memory-mapped indexed dataset: PREFIX.bin (token ids) + PREFIX.idx (sequence sizes, offsets, documents).

The .idx layout is Megatron-LM's `MMIDIDX` format, so files are interchangeable with Megatron's tools:
magic(9) version<Q>=1 dtype_code<B> num_sequences<Q> num_document_indices<Q> sizes[int32 * num_sequences]
pointers[int64 * num_sequences] document_indices[int64 * num_document_indices] and, in Megatron's multimodal
datasets only, modes[int8 * num_sequences]. A sequence is what `dataset[i]` returns; document d is sequences
document_indices[d] .. document_indices[d + 1] - 1 (one sequence each as we write them; one per sentence in
Megatron's --split-sentences datasets), so num_document_indices is the number of documents + 1.

Multimodal indexes are read (their modes in `modes`, one int8 per sequence) and kept by a merge; training reads
the tokens and ignores the modes. Megatron is told by its caller whether an index is multimodal; here the file's
size tells (the two layouts differ by num_sequences bytes).

A PREFIX may be a URL (``s3://bucket/data/pile_text_document``): the index is fetched whole into the cache (12
bytes per sequence, needed by every sample), the tokens are read by ranged requests through a bounded cache of
blocks (:mod:`mtnlg_lightning.corpora.block_cache`), so a run starts without copying the corpus.
"""

from __future__ import annotations

import hashlib
import os
import struct

import numpy as np

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.corpora.block_cache import BlockCache, RemoteArray
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.outputs import StagedFile

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
DATASET_SUFFIXES = (".bin", ".idx")  # the index last: written (and committed) last, it marks a dataset complete
# the token-block cache of datasets read from URLs, unless the data module says otherwise: its bound and the size of
# one ranged read (a few MiB: one request per block costs ~ms, and a block serves many consecutive samples)
REMOTE_CACHE_MB = 16384
REMOTE_BLOCK_KB = 4096


def remote_data_dir() -> str:
    return str(storage.cache_root() / "remote-data")


def default_block_cache(
    directory: str | None = None, max_mb: int = REMOTE_CACHE_MB, block_kb: int = REMOTE_BLOCK_KB
) -> BlockCache:
    """The token-block cache of datasets read from URLs: ``directory`` (default: the project cache's
    ``remote-data/blocks``) holding at most ``max_mb`` MiB of blocks of ``block_kb`` KiB."""
    return BlockCache(directory or os.path.join(remote_data_dir(), "blocks"), max_mb << 20, block_kb << 10)


def fetch_index(url: str) -> str:
    """A local copy of the remote index ``url`` (fetched again only when the remote file changes)."""
    version = storage.info(url).version
    digest = hashlib.sha256(f"{url}@{version}".encode()).hexdigest()[:24]
    local = os.path.join(remote_data_dir(), "index", f"{digest}.idx")
    if not os.path.exists(local):
        storage.download(url, local)
    return local


def best_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


class IndexedDatasetWriter:
    """Appends documents to PREFIX.bin; `finalize()` writes PREFIX.idx. Both appear atomically at the end.
    ``multimodal``: the index carries Megatron's per-sequence modes (every input appended must have them)."""

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype, multimodal: bool = False):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self.multimodal = multimodal
        self._staged_bin = StagedFile(self.prefix + ".bin")
        self._staged_idx = StagedFile(self.prefix + ".idx")
        self._bin = open(self._staged_bin.temp, "wb")
        # sequences written so far, in arrays (one per append_raw, one per run of add_document) ...
        self._sizes: list[np.ndarray] = []
        self._document_ends: list[np.ndarray] = []  # each document's end, in sequences from the start
        self._modes: list[np.ndarray] = []
        self._sequences = 0
        # ... and the documents added one by one since the last array
        self._pending_sizes: list[int] = []

    def add_document(self, token_ids) -> None:
        """One document of one sequence (mode 0 in a multimodal index)."""
        array = np.asarray(token_ids, dtype=self.dtype)
        self._bin.write(array.tobytes(order="C"))
        self._pending_sizes.append(array.size)

    def _flush_pending(self) -> None:
        if not self._pending_sizes:
            return
        count = len(self._pending_sizes)
        self._sizes.append(np.asarray(self._pending_sizes, dtype=np.int32))
        self._document_ends.append(self._sequences + np.arange(1, count + 1, dtype=np.int64))
        if self.multimodal:
            self._modes.append(np.zeros(count, dtype=np.int8))
        self._sequences += count
        self._pending_sizes = []

    def append_raw(self, dataset: IndexedDataset) -> None:
        """Every sequence of ``dataset`` (same dtype) appended with its document boundaries (and its modes, into a
        multimodal index), its tokens copied as bytes in blocks."""
        if (dataset.modes is not None) != self.multimodal:
            kind = "a multimodal" if dataset.modes is not None else "a text-only"
            raise MTNLGError(
                f"{dataset.prefix} has {kind} index and {self.prefix} would not; merge multimodal datasets only "
                "with multimodal ones"
            )
        self._flush_pending()
        tokens = dataset.tokens
        block = 1 << 24
        for start in range(0, len(tokens), block):
            self._bin.write(np.asarray(tokens[start : start + block]).tobytes(order="C"))
        self._sizes.append(np.array(dataset.sizes, dtype=np.int32))
        self._document_ends.append(self._sequences + np.asarray(dataset.doc_idx[1:], dtype=np.int64))
        if self.multimodal:
            self._modes.append(np.array(dataset.modes, dtype=np.int8))
        self._sequences += len(dataset)

    def finalize(self) -> None:
        self._flush_pending()
        self._bin.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.concatenate([np.zeros(1, dtype=np.int64), *self._document_ends])
        with open(self._staged_idx.temp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
            if self.multimodal:
                f.write(np.concatenate([np.zeros(0, dtype=np.int8), *self._modes]).tobytes(order="C"))
        self._staged_bin.commit()
        self._staged_idx.commit()  # the index last: it marks the dataset complete

    def abort(self) -> None:
        self._bin.close()
        self._staged_bin.discard()
        self._staged_idx.discard()


class IndexedDataset:
    """Read-only view; `dataset[i]` is sequence i as a numpy array (a memmap slice, no copy; for a URL, read
    through ``cache``, default :func:`default_block_cache`)."""

    def __init__(self, prefix: str | os.PathLike, cache: BlockCache | None = None):
        self.prefix = str(prefix)
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        remote = storage.is_url(self.prefix)
        for path in (idx_path, bin_path):
            if not storage.exists(path):
                raise MTNLGError(f"missing dataset file {path} (write it with mtnlg-preprocess)")
        if remote:
            idx_url, idx_path = idx_path, fetch_index(idx_path)
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_BYTES)
        shown = idx_url if remote else idx_path  # messages name the file the user named
        if len(header) < HEADER_BYTES or header[: len(MAGIC)] != MAGIC:
            raise MTNLGError(f"{shown} is not a Megatron MMIDIDX index file (bad or truncated header)")
        offset = len(MAGIC)
        (version,) = struct.unpack_from("<Q", header, offset)
        (code,) = struct.unpack_from("<B", header, offset + 8)
        (num_sequences,) = struct.unpack_from("<Q", header, offset + 9)
        (num_docs,) = struct.unpack_from("<Q", header, offset + 17)
        if version != VERSION or code not in DTYPE_CODES:
            raise MTNLGError(f"{shown}: unsupported index version {version} or dtype code {code}")
        text_only = HEADER_BYTES + num_sequences * (4 + 8) + num_docs * 8
        if idx_size not in (text_only, text_only + num_sequences):
            raise MTNLGError(
                f"{shown} is truncated or corrupt: {idx_size} bytes, header implies {text_only} "
                f"(or {text_only + num_sequences} with Megatron's multimodal modes)"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(index, dtype=np.int32, count=num_sequences, offset=HEADER_BYTES)
        self.pointers = np.frombuffer(
            index, dtype=np.int64, count=num_sequences, offset=HEADER_BYTES + self.sizes.nbytes
        )
        self.doc_idx = np.frombuffer(
            index, dtype=np.int64, count=num_docs, offset=HEADER_BYTES + self.sizes.nbytes + self.pointers.nbytes
        )
        # Megatron's multimodal index: one int8 mode per sequence after the document indices (empty with no
        # sequences, where the two layouts are the same bytes)
        self.modes = (
            np.frombuffer(index, dtype=np.int8, count=num_sequences, offset=text_only)
            if num_sequences and idx_size == text_only + num_sequences
            else None
        )
        if (
            num_docs == 0
            or self.doc_idx[0] != 0
            or self.doc_idx[-1] != num_sequences
            or (np.diff(self.doc_idx) < 0).any()
        ):
            raise MTNLGError(
                f"{shown} is corrupt: its document indices must rise from 0 to the {num_sequences} sequences"
            )
        expected_bin = int(self.sizes.astype(np.int64).sum()) * self.dtype.itemsize
        bin_size = storage.getsize(bin_path)
        if bin_size != expected_bin:
            raise MTNLGError(f"{bin_path} is truncated or corrupt: {bin_size} bytes, index implies {expected_bin}")
        if not bin_size:
            self.tokens = np.zeros(0, self.dtype)
        elif remote:
            self.tokens = RemoteArray(bin_path, self.dtype, cache or default_block_cache())
        else:
            self.tokens = np.memmap(bin_path, mode="r", dtype=self.dtype)

    @property
    def remote(self) -> bool:
        """Whether the tokens are read from a URL (through the block cache), not from a local memory map."""
        return isinstance(self.tokens, RemoteArray)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        start = self.pointers[i] // self.dtype.itemsize
        return self.tokens[start : start + self.sizes[i]]

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.astype(np.int64).sum())
