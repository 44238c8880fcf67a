"""Many PREFIX.bin/.idx pairs into one (as Megatron-LM's tools/merge_datasets.py): sequences in the order given,
each input's document boundaries kept (a --split-sentences dataset keeps its documents of several sentences) and its
multimodal modes with them; token bytes copied in blocks (memory holds one block and the index), written atomically."""

from __future__ import annotations

from mtnlg_lightning.data.indexed import IndexedDataset, IndexedDatasetWriter
from mtnlg_lightning.errors import MTNLGError


def merge_datasets(prefixes: list[str], output_prefix: str) -> tuple[int, int]:
    """Concatenate the datasets at ``prefixes`` into ``output_prefix``; returns (documents, tokens)."""
    if not prefixes:
        raise MTNLGError("nothing to merge: no dataset prefixes given")
    datasets = [IndexedDataset(p) for p in prefixes]
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
