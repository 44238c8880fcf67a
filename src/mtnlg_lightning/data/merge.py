"""Many PREFIX.bin/.idx pairs into one (as Megatron-LM's tools/merge_datasets.py): documents in the order given,
token bytes copied in blocks (memory holds one block and the document sizes), written atomically."""

from __future__ import annotations

from mtnlg_lightning.data.indexed import IndexedDataset, IndexedDatasetWriter
from mtnlg_lightning.errors import MTNLGError


def merge_datasets(prefixes: list[str], output_prefix: str) -> tuple[int, int]:
    """Concatenate the datasets at ``prefixes`` into ``output_prefix``; returns (documents, tokens)."""
    if not prefixes:
        raise MTNLGError("nothing to merge: no dataset prefixes given")
    datasets = [IndexedDataset(p) for p in prefixes]
    dtype = datasets[0].dtype
    for p, d in zip(prefixes, datasets, strict=True):
        if d.dtype != dtype:
            raise MTNLGError(f"{p}: token dtype {d.dtype} differs from {prefixes[0]}'s {dtype}; cannot merge")
    writer = IndexedDatasetWriter(output_prefix, dtype)
    try:
        for d in datasets:
            writer.append_raw(d)
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    return sum(len(d) for d in datasets), sum(d.num_tokens for d in datasets)
