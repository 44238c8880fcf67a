"""Megatron's memory-mapped indexed dataset: PREFIX.bin (token ids) + PREFIX.idx (document sizes/offsets).

The .idx layout is Megatron-LM's `MMIDIDX` format, so files are interchangeable with Megatron's tools:
magic(9) version<Q> dtype_code<B> num_sequences<Q> num_documents<Q> sizes[int32] pointers[int64] doc_idx[int64].
"""

from __future__ import annotations

import os
import struct

import numpy as np

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


def best_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


class IndexedDatasetWriter:
    """Appends documents to PREFIX.bin; `finalize()` writes PREFIX.idx. Both appear atomically at the end."""

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self._staged_bin = StagedFile(self.prefix + ".bin")
        self._staged_idx = StagedFile(self.prefix + ".idx")
        self._bin = open(self._staged_bin.temp, "wb")
        self._sizes: list[int] = []

    def add_document(self, token_ids) -> None:
        array = np.asarray(token_ids, dtype=self.dtype)
        self._bin.write(array.tobytes(order="C"))
        self._sizes.append(array.size)

    def append_raw(self, dataset: IndexedDataset) -> None:
        """Every document of ``dataset`` (same dtype) appended, its tokens copied as bytes in blocks."""
        tokens = dataset.tokens
        block = 1 << 24
        for start in range(0, len(tokens), block):
            self._bin.write(np.asarray(tokens[start : start + block]).tobytes(order="C"))
        self._sizes.extend(dataset.sizes.tolist())

    def finalize(self) -> None:
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        with open(self._staged_idx.temp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
        self._staged_bin.commit()
        self._staged_idx.commit()  # the index last: it marks the dataset complete

    def abort(self) -> None:
        self._bin.close()
        self._staged_bin.discard()
        self._staged_idx.discard()


class IndexedDataset:
    """Read-only view; `dataset[i]` is document i as a numpy array (a memmap slice, no copy)."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.exists(path):
                raise MTNLGError(f"missing dataset file {path} (write it with tools/preprocess_data.py)")
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES or header[: len(MAGIC)] != MAGIC:
            raise MTNLGError(f"{idx_path} is not a Megatron MMIDIDX index file (bad or truncated header)")
        offset = len(MAGIC)
        (version,) = struct.unpack_from("<Q", header, offset)
        (code,) = struct.unpack_from("<B", header, offset + 8)
        (num_sequences,) = struct.unpack_from("<Q", header, offset + 9)
        (num_docs,) = struct.unpack_from("<Q", header, offset + 17)
        if version != VERSION or code not in DTYPE_CODES:
            raise MTNLGError(f"{idx_path}: unsupported index version {version} or dtype code {code}")
        expected = HEADER_BYTES + num_sequences * (4 + 8) + num_docs * 8
        if idx_size != expected:
            raise MTNLGError(f"{idx_path} is truncated or corrupt: {idx_size} bytes, header implies {expected}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(index, dtype=np.int32, count=num_sequences, offset=HEADER_BYTES)
        self.pointers = np.frombuffer(
            index, dtype=np.int64, count=num_sequences, offset=HEADER_BYTES + self.sizes.nbytes
        )
        self.doc_idx = np.frombuffer(
            index, dtype=np.int64, count=num_docs, offset=HEADER_BYTES + self.sizes.nbytes + self.pointers.nbytes
        )
        expected_bin = int(self.sizes.astype(np.int64).sum()) * self.dtype.itemsize
        bin_size = os.path.getsize(bin_path)
        if bin_size != expected_bin:
            raise MTNLGError(f"{bin_path} is truncated or corrupt: {bin_size} bytes, index implies {expected_bin}")
        self.tokens = np.memmap(bin_path, mode="r", dtype=self.dtype) if bin_size else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        start = self.pointers[i] // self.dtype.itemsize
        return self.tokens[start : start + self.sizes[i]]

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.astype(np.int64).sum())
