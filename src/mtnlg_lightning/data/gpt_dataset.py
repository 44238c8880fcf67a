"""GPT training samples: documents (already ending in EOD) packed into seq_len+1 token windows, shuffled."""

from __future__ import annotations

import numpy as np

from mtnlg_lightning.data.indexed import IndexedDataset
from mtnlg_lightning.errors import MTNLGError


def split_ranges(num_docs: int, split: str) -> list[tuple[int, int]]:
    """Megatron's "969,30,1" style split of documents into train/valid/test ranges (by document)."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        raise MTNLGError(f"split {split!r} must be comma-separated numbers, e.g. '969,30,1'") from None
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    if sum(weights) <= 0 or min(weights) < 0:
        raise MTNLGError(f"split {split!r} must have non-negative weights with a positive sum")
    bounds = np.round(np.cumsum([0.0] + weights) / sum(weights) * num_docs).astype(int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(3)]


class GPTDataset:
    """Sample i is a window of seq_len+1 tokens of the document stream; windows overlap by one token
    (inputs = window[:-1], labels = window[1:]). Epoch e shuffles the documents, and the samples of block e,
    with generators seeded by (seed, e): the order is a pure function of (files, split, seq_len, seed), and a
    dataset built for more samples extends a smaller one (so the planned run length never changes the data)."""

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_range: tuple[int, int],
        seq_len: int,
        num_samples: int,
        seed: int,
        name: str = "",
    ):
        self.indexed, self.seq_len, self.name = indexed, seq_len, name
        docs = np.arange(*doc_range, dtype=np.int64)
        tokens_per_epoch = int(indexed.sizes[docs].astype(np.int64).sum()) if len(docs) else 0
        if tokens_per_epoch <= seq_len:
            raise MTNLGError(
                f"dataset {name or indexed.prefix}: this split has {tokens_per_epoch} tokens, fewer than one "
                f"sample of {seq_len + 1}; use more data or a different split"
            )
        samples_per_epoch = (tokens_per_epoch - 1) // seq_len
        self.num_epochs = max(1, -(-num_samples // samples_per_epoch))
        epochs = range(self.num_epochs)
        self.doc_order = np.concatenate([np.random.default_rng([seed, e, 0]).permutation(docs) for e in epochs])
        self.doc_starts = np.zeros(len(self.doc_order) + 1, dtype=np.int64)
        np.cumsum(indexed.sizes[self.doc_order], out=self.doc_starts[1:])
        # Block e holds samples [e*spe, (e+1)*spe); its last window ends within the stream of E epochs.
        self.shuffle = np.concatenate(
            [e * samples_per_epoch + np.random.default_rng([seed, e, 1]).permutation(samples_per_epoch) for e in epochs]
        )

    def __len__(self) -> int:
        return len(self.shuffle)

    def _window(self, i: int) -> tuple[int, int, int, int]:
        """Sample i's [start, end) in the document stream and the first and last stream documents it touches."""
        start = int(self.shuffle[i]) * self.seq_len
        end = start + self.seq_len + 1
        first = int(np.searchsorted(self.doc_starts, start, side="right")) - 1
        last = int(np.searchsorted(self.doc_starts, end - 1, side="right")) - 1
        return start, end, first, last

    def __getitem__(self, i: int) -> np.ndarray:
        start, end, first, last = self._window(i)
        pieces = []
        for k in range(first, last + 1):
            doc = self.indexed[int(self.doc_order[k])]
            lo = max(start - int(self.doc_starts[k]), 0)
            hi = min(end - int(self.doc_starts[k]), len(doc))
            pieces.append(doc[lo:hi])
        return np.concatenate(pieces).astype(np.int64)

    def document_ids(self, i: int) -> np.ndarray:
        """The document of each of sample i's seq_len+1 tokens, numbered from 0 within the window (document
        masking: `--data.document_mask`)."""
        start, end, first, last = self._window(i)
        starts_inside = self.doc_starts[first + 1 : last + 1] - start
        return np.searchsorted(starts_inside, np.arange(end - start), side="right").astype(np.int64)


class BlendedDataset:
    """Interleaves datasets so that any prefix of n samples holds within one sample of weight_i * n from dataset i.

    Dataset i's k-th sample sits at position (k + 0.5) / w_i; merging those positions gives an exact, smooth,
    deterministic allocation (the same guarantee as Megatron's greedy blending) computed in numpy.
    """

    def __init__(self, datasets: list, weights: list[float], num_samples: int):
        if len(datasets) != len(weights) or not datasets:
            raise MTNLGError("a blend needs one weight per dataset and at least one dataset")
        weights = np.asarray(weights, dtype=np.float64)
        if (weights <= 0).any():
            raise MTNLGError(f"blend weights must be positive, got {weights.tolist()}")
        self.weights = weights / weights.sum()
        self.datasets = datasets
        picks = [np.arange(int(np.ceil(w * num_samples)) + 1) for w in self.weights]
        positions = np.concatenate([(p + 0.5) / w for p, w in zip(picks, self.weights, strict=True)])
        owners = np.concatenate([np.full(len(p), i, dtype=np.int32) for i, p in enumerate(picks)])
        order = np.lexsort((owners, positions))[:num_samples]
        self.dataset_index = owners[order]
        self.sample_index = np.concatenate([p for p in picks])[order]
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for dataset, count in zip(datasets, counts, strict=True):
            if count > len(dataset):  # cannot happen when sub-datasets were sized by `samples_needed`
                raise MTNLGError(f"blend needs {count} samples from a dataset that has {len(dataset)}")

    @staticmethod
    def samples_needed(weights: list[float], num_samples: int) -> list[int]:
        total = float(sum(weights))
        return [int(np.ceil(w / total * num_samples)) + 1 for w in weights]

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[self.dataset_index[i]][int(self.sample_index[i])]

    def document_ids(self, i: int) -> np.ndarray:
        return self.datasets[self.dataset_index[i]].document_ids(int(self.sample_index[i]))
