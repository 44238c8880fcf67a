"""Many PREFIX.bin/.idx pairs into one (as Megatron-LM's tools/merge_datasets.py): sequences in the order given,
each input's document boundaries kept (a --split-sentences dataset keeps its documents of several sentences) and its
multimodal modes with them; token bytes copied in blocks (memory holds one block and the index), written atomically."""

from __future__ import annotations

import tempfile

from mtnlg_lightning.corpora.block_cache import BlockCache
from mtnlg_lightning.corpora.commit import output_files
from mtnlg_lightning.data.indexed import DATASET_SUFFIXES, IndexedDataset, IndexedDatasetWriter
from mtnlg_lightning.errors import MTNLGError

MERGE_CACHE_BYTES = 64 << 20


def merge_datasets(prefixes: list[str], output_prefix: str) -> tuple[int, int]:
    """Concatenate the datasets at ``prefixes`` into ``output_prefix`` (paths or URLs; an output URL is written
    locally and committed there, the .idx last); returns (documents, tokens)."""
    if not prefixes:
        raise MTNLGError("nothing to merge: no dataset prefixes given")
    with output_files(output_prefix, DATASET_SUFFIXES) as local_prefix:
        return _merge(prefixes, local_prefix)


def _merge(prefixes: list[str], output_prefix: str) -> tuple[int, int]:
    # a dataset read from a URL streams through a cache of its own, dropped with the merge: the tokens are read
    # once, in order, and must not push a training run's blocks out of the shared cache
    with tempfile.TemporaryDirectory(prefix="mtnlg-merge-blocks-") as blocks:
        cache = BlockCache(blocks, max_bytes=MERGE_CACHE_BYTES)
        datasets = [IndexedDataset(p, cache) for p in prefixes]
        return _append_all(prefixes, datasets, output_prefix)


def _append_all(prefixes: list[str], datasets: list[IndexedDataset], output_prefix: str) -> tuple[int, int]:
    dtype, multimodal = datasets[0].dtype, datasets[0].modes is not None
    for p, d in zip(prefixes, datasets, strict=True):
        if d.dtype != dtype:
            raise MTNLGError(f"{p}: token dtype {d.dtype} differs from {prefixes[0]}'s {dtype}; cannot merge")
        if (d.modes is not None) != multimodal:
            which = {True: "multimodal (per-sequence modes)", False: "text-only"}
            raise MTNLGError(
                f"{p}'s index is {which[d.modes is not None]} and {prefixes[0]}'s is {which[multimodal]}; "
                "merge datasets of one kind"
            )
    writer = IndexedDatasetWriter(output_prefix, dtype, multimodal=multimodal)
    try:
        for d in datasets:
            writer.append_raw(d)
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    return sum(d.num_documents for d in datasets), sum(d.num_tokens for d in datasets)
