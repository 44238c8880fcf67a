"""Examples into rows of `seq_len` tokens: packed by best-fit decreasing, or one example per row.

Each example arrives shifted on its own (its labels are its own next tokens, IGNORE_INDEX where not trained, its
last position never trained: nothing follows it in its document), so no label crosses into the next document. A
row carries, per position:
- `input_ids`, `labels`;
- `position_ids`: 0, 1, ... restarting at each document (as the document would see them alone);
- `document_ids`: 0 for the row's first document, 1 for the second, ..., PADDING_DOCUMENT for the padding at the
  row's end (labels IGNORE_INDEX there): attention stays within a document (block-diagonal causal).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mtnlg_lightning.loss import IGNORE_INDEX

PADDING_DOCUMENT = -1
ROW_FIELDS = ("input_ids", "labels", "position_ids", "document_ids")
# [B]: the positions before each row's padding. A layout that may change shapes computes a micro-batch only up to its
# longest row, rounded up to a multiple of ROW_MULTIPLE (`train.step_interfaces.micro_batches_of`): one example per
# row leaves most of seq_len as padding, and its attention and output layer would cost as much as the documents.
ROW_LENGTHS = "row_lengths"
# [B], optional: the length by which rows are grouped into micro-batches when it is not each row's own, the same for
# rows that must stay adjacent and in order (a preference pair's chosen and rejected rows: the longer one's length).
GROUP_LENGTHS = "group_lengths"
# 8: what bf16 tensor-core tiles want, and at most 7 padded positions a row (64, GRPO's, made bench_finetune's steps
# on 74-token chats 9% slower); sequence and context parallelism's cuts are added to it (`RowWidths`)
ROW_MULTIPLE = 8


@dataclass
class Example:
    input_ids: np.ndarray  # int64 [L], L <= seq_len
    labels: np.ndarray  # int64 [L]: input_ids[j + 1] where trained, else IGNORE_INDEX

    def __len__(self) -> int:
        return len(self.input_ids)


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each summing to at most `capacity`: the longest item first, each into the fullest bin
    it fits in (ties to the earlier bin), else a new bin. Deterministic for given lengths."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin index), sorted: the best fit is the first with enough space
    for item in order:
        length = lengths[item]
        if length > capacity:
            raise ValueError(f"item {item} of length {length} exceeds the capacity {capacity}")
        at = bisect.bisect_left(free, (length, -1))
        if at < len(free):
            space, index = free.pop(at)
        else:
            space, index = capacity, len(bins)
            bins.append([])
        bins[index].append(item)
        if space - length > 0:
            bisect.insort(free, (space - length, index))
    return bins


def assemble_row(examples: Sequence[Example], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One row of `seq_len` positions holding `examples` in order, then padding."""
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros(seq_len, dtype=np.int64)
    document_ids = np.full(seq_len, PADDING_DOCUMENT, dtype=np.int64)
    start = 0
    for document, example in enumerate(examples):
        end = start + len(example)
        if end > seq_len:
            raise ValueError(f"examples of {end} tokens do not fit a row of {seq_len}")
        input_ids[start:end] = example.input_ids
        labels[start:end] = example.labels
        position_ids[start:end] = np.arange(len(example))
        document_ids[start:end] = document
        start = end
    position_ids[start:] = np.arange(seq_len - start)  # the padding is a sequence of its own
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "document_ids": document_ids}


class Rows:
    """Rows of examples (a plan of example indices per row), assembled when read."""

    def __init__(self, examples: Sequence[Example], plan: list[list[int]], seq_len: int, pad_id: int):
        self.examples, self.plan, self.seq_len, self.pad_id = examples, plan, seq_len, pad_id

    @classmethod
    def packed(cls, examples: Sequence[Example], seq_len: int, pad_id: int) -> Rows:
        return cls(examples, best_fit_decreasing([len(e) for e in examples], seq_len), seq_len, pad_id)

    @classmethod
    def one_per_row(cls, examples: Sequence[Example], seq_len: int, pad_id: int) -> Rows:
        return cls(examples, [[i] for i in range(len(examples))], seq_len, pad_id)

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return assemble_row([self.examples[i] for i in self.plan[index]], self.seq_len, self.pad_id)

    def token_share(self) -> float:
        """The share of positions that hold a document's token (the rest is padding)."""
        return sum(len(e) for e in self.examples) / max(1, len(self.plan) * self.seq_len)


class ShuffledRows:
    """`count` samples drawn epoch by epoch from `rows`, each epoch in its own permutation seeded by (seed, epoch):
    the order depends on the seed only, not on the layout or the loader workers."""

    def __init__(self, rows: Rows, count: int, seed: int):
        self.rows, self.count, self.seed = rows, count, seed
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.count

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        return self._orders[epoch]

    def source_index(self, index: int) -> int:
        """Which of `rows` sample `index` is."""
        epoch, at = divmod(index, len(self.rows))
        return int(self._order(epoch)[at])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.rows[self.source_index(index)]


def rows_batch(rows: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Rows stacked into a batch: each of ROW_FIELDS [B, seq_len] int64, and ROW_LENGTHS [B] (the padding is at
    each row's end)."""
    batch = {field: torch.from_numpy(np.stack([row[field] for row in rows])) for field in ROW_FIELDS}
    batch[ROW_LENGTHS] = (batch["document_ids"] != PADDING_DOCUMENT).sum(dim=1)
    return batch
