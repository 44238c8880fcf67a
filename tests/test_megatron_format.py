"""Megatron-LM's indexed datasets kept exact: `tools/preprocess_data.py --merge` of Megatron-written datasets gives the
bytes Megatron's own merge (tools/merge_datasets.py: IndexedDatasetBuilder.add_index, then finalize) gives, for its
--split-sentences layout (several sequences per document) and its multimodal index (a mode byte per sequence);
the reader takes both.

The expected bytes are built here from the on-disk format alone (megatron/core/datasets/indexed_dataset.py's
_IndexWriter), not by the code under test:
    .idx  b"MMIDIDX\\x00\\x00"  version <Q> = 1  dtype code <B>  sequence count <Q>  document-index count <Q>
          sequence lengths int32[]  sequence pointers int64[] (byte offsets: running sum of length * itemsize)
          document indices int64[] (0, then the end of each document in sequences)  [modes int8[], multimodal only]
    .bin  the tokens, sequence after sequence
and Megatron's merge concatenates the .bin files and the sequence lengths (and modes), recomputes the pointers, and
appends each input's document indices but its leading 0, shifted by the sequences before it.
"""

from __future__ import annotations

import itertools
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mtnlg_lightning.data.gpt_dataset import GPTDataset
from mtnlg_lightning.data.indexed import IndexedDataset
from mtnlg_lightning.errors import MTNLGError

ROOT = Path(__file__).resolve().parents[1]
UINT16, INT32 = 8, 4  # Megatron's DType codes


def megatron_files(code: int, sequences: list[list[int]], document_indices: list[int], modes=None) -> dict:
    """{".bin": bytes, ".idx": bytes} of a Megatron indexed dataset, from the format definition."""
    dtype = {UINT16: np.uint16, INT32: np.int32}[code]
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * np.dtype(dtype).itemsize)[:-1]])
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(document_indices))
    idx += lengths.tobytes() + pointers.astype(np.int64).tobytes() + np.array(document_indices, np.int64).tobytes()
    if modes is not None:
        idx += np.array(modes, dtype=np.int8).tobytes()
    tokens = np.concatenate([np.array(s, dtype=dtype) for s in sequences]) if sequences else np.zeros(0, dtype)
    return {".bin": tokens.tobytes(), ".idx": idx}


def sentence_split_part(documents: list[list[list[int]]], code: int = UINT16, modes_of=None) -> dict:
    """A --split-sentences dataset: each document a list of sentences, each sentence one sequence."""
    sequences = [sentence for doc in documents for sentence in doc]
    ends = np.cumsum([len(doc) for doc in documents]).tolist()
    modes = None if modes_of is None else [modes_of(i) for i in range(len(sequences))]
    return {
        "sequences": sequences,
        "document_indices": [0, *ends],
        "modes": modes,
        "files": megatron_files(code, sequences, [0, *ends], modes),
    }


def megatron_merge(parts: list[dict], code: int = UINT16) -> dict:
    """The files Megatron's merge writes for ``parts``, in this order."""
    sequences, document_indices, modes = [], [0], []
    for part in parts:
        document_indices += [len(sequences) + end for end in part["document_indices"][1:]]
        sequences += part["sequences"]
        modes += part["modes"] or []
    return megatron_files(code, sequences, document_indices, modes if parts[0]["modes"] is not None else None)


def write(prefix: Path, files: dict) -> str:
    for suffix, data in files.items():
        Path(str(prefix) + suffix).write_bytes(data)
    return str(prefix)


def documents(rng, count: int, first_token: int) -> list[list[list[int]]]:
    """``count`` documents of 1-4 sentences of 1-9 tokens; every token distinct, so any misplacement shows."""
    out, token = [], first_token
    for _ in range(count):
        doc = []
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(1, 10))
            doc.append(list(range(token, token + n)))
            token += n
        out.append(doc)
    return out


def preprocess_merge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--merge", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("multimodal", [False, True], ids=["sentence_split", "multimodal"])
def test_a_merge_of_megatron_parts_is_megatrons_merge_byte_for_byte(tmp_path, multimodal):
    rng = np.random.default_rng(0)
    modes_of = (lambda i: i % 3) if multimodal else None
    parts = [sentence_split_part(documents(rng, n, 1000 * k + 1), modes_of=modes_of) for k, n in enumerate((7, 1, 5))]
    assert any(len(p["sequences"]) > len(p["document_indices"]) - 1 for p in parts)  # documents of several sentences
    prefixes = [write(tmp_path / f"part{k}", p["files"]) for k, p in enumerate(parts)]

    proc = preprocess_merge(*prefixes, "--output-prefix", str(tmp_path / "merged"))
    assert proc.returncode == 0, proc.stderr
    expected = megatron_merge(parts)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"merged{suffix}").read_bytes() == expected[suffix], suffix
    total_docs = sum(len(p["document_indices"]) - 1 for p in parts)
    assert f"{total_docs} documents ({sum(len(p['sequences']) for p in parts)} sequences" in proc.stdout
    assert ("multimodal modes" in proc.stdout) == multimodal


def test_the_reader_takes_megatrons_multimodal_index_and_reads_its_modes(tmp_path):
    part = sentence_split_part(documents(np.random.default_rng(1), 6, 1), modes_of=lambda i: (i * 7) % 5 - 2)
    dataset = IndexedDataset(write(tmp_path / "mm", part["files"]))
    assert [dataset[i].tolist() for i in range(len(dataset))] == part["sequences"]
    assert dataset.modes.tolist() == part["modes"]
    assert dataset.doc_idx.tolist() == part["document_indices"] and dataset.num_documents == 6

    text_only = IndexedDataset(write(tmp_path / "plain", sentence_split_part([[[5, 6], [7]], [[8]]])["files"]))
    assert text_only.modes is None and text_only.doc_idx.tolist() == [0, 2, 3]

    # training reads the tokens and passes the modes by: each window runs through whole sequences, in some order
    samples = GPTDataset(dataset, (0, len(dataset)), seq_len=8, num_samples=4, seed=0)
    ends, starts = {s[-1] for s in part["sequences"]}, {s[0] for s in part["sequences"]}
    for window in (samples[i].tolist() for i in range(4)):
        assert len(window) == 9
        assert all(b == a + 1 or (a in ends and b in starts) for a, b in itertools.pairwise(window))


def test_a_merge_of_int32_parts_keeps_the_dtype_code(tmp_path):
    parts = [sentence_split_part(documents(np.random.default_rng(k), 3, 70_000 * (k + 1)), code=INT32) for k in (0, 1)]
    prefixes = [write(tmp_path / f"p{k}", p["files"]) for k, p in enumerate(parts)]
    assert preprocess_merge(*prefixes, "--output-prefix", str(tmp_path / "m")).returncode == 0
    assert (tmp_path / "m.idx").read_bytes() == megatron_merge(parts, code=INT32)[".idx"]


def test_bad_megatron_indexes_are_one_line_errors(tmp_path):
    plain = write(tmp_path / "plain", sentence_split_part([[[1, 2], [3]]])["files"])
    multimodal = write(tmp_path / "mm", sentence_split_part([[[4], [5, 6]]], modes_of=lambda i: 1)["files"])
    proc = preprocess_merge(plain, multimodal, "--output-prefix", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "multimodal" in proc.stderr and "text-only" in proc.stderr
    assert not (tmp_path / "out.idx").exists() and not (tmp_path / "out.bin").exists()
    assert not list(tmp_path.glob(".out*"))  # no staged file left behind

    broken = megatron_files(UINT16, [[1], [2]], [0, 1, 5])  # the last document ends past the sequences
    with pytest.raises(MTNLGError, match="document indices must rise from 0 to the 2 sequences"):
        IndexedDataset(write(tmp_path / "broken", broken))
