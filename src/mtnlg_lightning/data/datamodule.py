"""The LightningDataModule: indexed datasets -> packed GPT samples -> weighted blend -> DP-sharded step batches."""

from __future__ import annotations

import os

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mtnlg_lightning.corpora.storage import is_url
from mtnlg_lightning.data.builtin_corpora import build_builtin_corpus, find_builtin_corpus
from mtnlg_lightning.data.gpt_dataset import BlendedDataset, GPTDataset, split_ranges
from mtnlg_lightning.data.indexed import REMOTE_BLOCK_KB, REMOTE_CACHE_MB, IndexedDataset, default_block_cache
from mtnlg_lightning.data.tokenizer import local_tokenizer
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.loss import IGNORE_INDEX

SPLITS = ("train", "valid", "test")


class StepBatches(IterableDataset):
    """Yields, for each optimizer step, this data-parallel rank's share of the global batch
    (`language_modelling_batch`, with the step's `consumed_samples` and `global_batch_size`).

    The global batch of a step is the contiguous sample range [consumed, consumed + batch size) of the blend,
    where the batch size comes from the ramp-up schedule; DP rank r takes the r-th contiguous slice (as
    Megatron's pretraining sampler). Tensor- and pipeline-parallel ranks with the same DP rank get the same data.
    With several loader workers, worker w produces steps w, w+W, ...: the DataLoader's round-robin keeps order.
    `collate` turns the rank's samples into its batch (default: token windows, `window_batch`); `document_mask`:
    each window's documents attend only to themselves (the samples come with their document ids:
    `documented_window_batch`).
    """

    def __init__(
        self,
        dataset,
        batch_size_at,
        start_samples: int,
        end_samples: int,
        dp_rank: int,
        dp_size: int,
        collate=None,
        document_mask: bool = False,
    ):
        self.dataset, self.batch_size_at = dataset, batch_size_at
        self.collate = collate or (documented_window_batch if document_mask else window_batch)
        self.start_samples, self.end_samples = start_samples, end_samples
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.document_mask = document_mask

    def _steps(self, start: int | None = None):
        consumed = self.start_samples if start is None else start
        while consumed < self.end_samples:
            size = self.batch_size_at(consumed)
            yield consumed, size
            consumed += size

    def __len__(self) -> int:
        """Steps of the whole split from its first sample, not from `start_samples`: a resumed run restores
        Lightning's in-epoch batch count, and that count plus the steps left must add up to the epoch's length
        (counted from the start, a resumed epoch would end early and the loader would replay its data)."""
        return sum(1 for _ in self._steps(0))

    def __iter__(self):
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        for step, (consumed, size) in enumerate(self._steps()):
            if step % num_workers != worker_id:
                continue
            local = size // self.dp_size
            first = consumed + self.dp_rank * local
            samples = [i % len(self.dataset) for i in range(first, first + local)]
            if self.document_mask:
                rows = [(self.dataset[i], self.dataset.document_ids(i)) for i in samples]
            else:
                rows = [self.dataset[i] for i in samples]
            yield {
                **self.collate(rows),
                "consumed_samples": torch.tensor(consumed),
                "global_batch_size": torch.tensor(size),
            }


def window_batch(windows: list[np.ndarray]) -> dict[str, torch.Tensor]:
    return language_modelling_batch(torch.from_numpy(np.stack(windows)))


def documented_window_batch(rows: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Windows with each token's document id (`GPTDataset.document_ids`)."""
    windows, documents = (torch.from_numpy(np.stack(part)) for part in zip(*rows, strict=True))
    return language_modelling_batch(windows, documents)


def language_modelling_batch(windows: torch.Tensor, documents: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Windows of seq_len + 1 tokens [B, S + 1] as the model trains on them: `input_ids` [B, S], `labels` [B, S]
    (each position's next token: the one shift of the project) and `position_ids` [B, S] (0..S-1: a window of the
    document stream is one sequence).

    With `documents` [B, S + 1] (each token's document in its window), as Llama 3 trains: `document_ids` [B, S] (the
    input tokens'), positions restarting at 0 at each document, and no label across a boundary (a document's last
    token does not predict the next document's first: IGNORE_INDEX)."""
    input_ids, labels = windows[:, :-1], windows[:, 1:]
    if documents is None:
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return {
            "input_ids": input_ids.contiguous(),
            "labels": labels.contiguous(),
            "position_ids": positions.contiguous(),
        }
    document_ids = documents[:, :-1].contiguous()
    labels = labels.masked_fill(documents[:, 1:] != document_ids, IGNORE_INDEX)
    return {
        "input_ids": input_ids.contiguous(),
        "labels": labels.contiguous(),
        "position_ids": positions_within_documents(document_ids),
        "document_ids": document_ids,
    }


def positions_within_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S]: each token's place in its document (0 at a document's first token), from ids that change only where
    a document starts."""
    index = torch.arange(document_ids.shape[1]).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first_of_document = torch.where(starts, index, 0).cummax(dim=1).values
    return (index - first_of_document).contiguous()


class StepDataModule(L.LightningDataModule):
    """What every data module of the trainer shares: samples per split (`splits`, filled by `setup`) served as
    `StepBatches` of this data-parallel rank, each rank's samples turned into a batch by `collate`."""

    collate = None  # StepBatches' default: token windows
    document_mask = False  # the windows' document ids travel with them (GPTDataModule's --data.document_mask)

    def __init__(self):
        super().__init__()
        self.splits: dict = {}

    # The recipe (sequence length, batch schedule) is owned by the LightningModule, the data position by its
    # `TrainingPosition`, the DP layout by the strategy.
    @property
    def _module(self):
        return self.trainer.lightning_module

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        strategy = self.trainer.strategy
        return (
            getattr(strategy, "data_parallel_rank", self.trainer.global_rank),
            getattr(strategy, "data_parallel_size", self.trainer.world_size),
        )

    def train_dataloader(self):
        module = self._module
        dp_rank, dp_size = self.data_parallel_rank_and_size()
        module.batch_schedule.check_divisible(module.micro_batch_size, dp_size)
        samples = self.splits["train"]
        start = module.position.consumed_samples  # a resume or a rewind restarts the stream there
        steps = StepBatches(
            samples,
            module.batch_schedule.batch_size_at_samples,
            start,
            len(samples),
            dp_rank,
            dp_size,
            self.collate,
            self.document_mask,
        )
        return DataLoader(steps, batch_size=None, num_workers=self.num_workers)

    def _eval_dataloader(self, name: str):
        if name not in self.splits:
            return []
        dp_rank, dp_size = self.data_parallel_rank_and_size()
        # Evaluation batches are global batches (as Megatron's eval iterations): the same micro-batch count per
        # rank as training, which pipeline schedules need.
        size = self._module.batch_schedule.global_batch_size
        samples = self.splits[name]
        end = len(samples) - len(samples) % size
        batches = StepBatches(samples, lambda _: size, 0, end, dp_rank, dp_size, self.collate, self.document_mask)
        return DataLoader(batches, batch_size=None, num_workers=self.num_workers)

    def val_dataloader(self):
        return self._eval_dataloader("valid")

    def test_dataloader(self):
        return self._eval_dataloader("test")


class GPTDataModule(StepDataModule):
    def __init__(
        self,
        datasets: list[str] | None = None,
        weights: list[float] | None = None,
        builtin_corpus: str | None = None,
        split: str = "969,30,1",
        seed: int = 1234,
        num_workers: int = 0,
        eval_samples: int | None = None,
        tokenizer: str | None = None,
        remote_cache_dir: str | None = None,
        remote_cache_mb: int = REMOTE_CACHE_MB,
        remote_block_kb: int = REMOTE_BLOCK_KB,
        document_mask: bool = False,
    ):
        """
        Args:
            datasets: dataset prefixes (PREFIX.bin/PREFIX.idx written by mtnlg-preprocess), paths or URLs
                (s3://bucket/data/pile_text_document: read by ranged requests through the block cache, no copy).
            weights: blend weight per dataset (normalised; default equal). MT-NLG blended 15 datasets.
            builtin_corpus: a built-in corpus instead of `datasets`, built once and cached: "python-docs", the
                offline demo corpus (others as installed packages register them: data.builtin_corpora).
            split: train/valid/test split of each dataset's documents, Megatron style.
            seed: seed of document and sample shuffling (data order is independent of the layout).
            num_workers: DataLoader worker processes.
            eval_samples: validation/test samples per evaluation (default: one pass over the split, capped at 1024).
            tokenizer: the tokenizer the datasets were made with (a tokenizer.json, or a directory holding one);
                copied into every checkpoint so export, generation and evaluation find it (the built-in corpus
                brings its own).
            remote_cache_dir: where the token blocks of datasets named by URLs are cached (default: the project
                cache's remote-data/blocks; ranks and loader workers of a node may share it).
            remote_cache_mb: the most MiB of token blocks that cache holds (least recently used go first).
            remote_block_kb: the size of one block: one ranged request each.
            document_mask: attention stays within each document of a window (block-diagonal causal), positions
                restart at each document and no label crosses a boundary, as Llama 3 trains; false (MT-NLG's): a
                window is one sequence.
        """
        super().__init__()
        if builtin_corpus is not None:
            find_builtin_corpus(builtin_corpus)  # an unknown name fails here, in one line
        if not datasets and not builtin_corpus:
            raise MTNLGError("no data: set data.datasets (PREFIX paths) or data.builtin_corpus: python-docs")
        if weights is not None and len(weights) != len(datasets or []):
            raise MTNLGError(f"data.weights has {len(weights)} entries for {len(datasets or [])} datasets")
        self.prefixes = list(datasets or [])
        self.weights = list(weights) if weights is not None else [1.0] * len(self.prefixes)
        self.builtin_corpus, self.split, self.seed = builtin_corpus, split, seed
        self.num_workers, self.eval_samples = num_workers, eval_samples
        self.tokenizer = tokenizer
        self.remote_cache = (remote_cache_dir, remote_cache_mb, remote_block_kb)
        self.document_mask = document_mask

    @property
    def tokenizer_file(self) -> str | None:
        """The tokenizer.json of the data, if known."""
        if self.builtin_corpus:
            return build_builtin_corpus(self.builtin_corpus, progress=False)[1]
        tokenizer = local_tokenizer(self.tokenizer) if self.tokenizer else None  # a URL: a copy in the cache
        if tokenizer and os.path.isdir(tokenizer):
            candidate = os.path.join(tokenizer, "tokenizer.json")
            return candidate if os.path.isfile(candidate) else None
        return tokenizer

    def prepare_data(self) -> None:
        if self.builtin_corpus:
            build_builtin_corpus(self.builtin_corpus)

    @property
    def blends(self) -> dict[str, BlendedDataset]:
        """The blended samples of each split."""
        return self.splits

    def setup(self, stage: str | None = None) -> None:
        if self.builtin_corpus:
            self.prefixes, self.weights = [build_builtin_corpus(self.builtin_corpus, progress=False)[0]], [1.0]
        seq_len = self._module.config.seq_len
        vocab = self._module.config.padded_vocab_size()
        cache = None
        if any(is_url(p) for p in self.prefixes):
            cache = default_block_cache(*self.remote_cache)
        indexed = [IndexedDataset(p, cache) for p in self.prefixes]
        for ds in indexed:  # a full scan is cheap up to a few hundred million local tokens; skipped above that
            if not ds.remote and 0 < ds.num_tokens <= 256_000_000 and int(ds.tokens.max()) >= vocab:
                raise MTNLGError(
                    f"{ds.prefix} holds token ids >= the model's vocabulary {vocab}; "
                    f"set model.vocab_size to the tokenizer's size"
                )
        ranges = [split_ranges(len(ds), self.split) for ds in indexed]  # per dataset: train, valid, test
        split_tokens = [
            sum(int(ds.sizes[slice(*r[index])].astype(np.int64).sum()) for ds, r in zip(indexed, ranges, strict=True))
            for index in range(len(SPLITS))
        ]
        max_steps = self.trainer.max_steps if self.trainer is not None else -1
        if max_steps and max_steps > 0:
            counts = {"train": self._module.batch_schedule.consumed_samples(max_steps)}
        else:  # one pass over the training split
            counts = {"train": max(1, split_tokens[0] // seq_len)}
        for index, name in enumerate(SPLITS[1:], start=1):
            counts[name] = self.eval_samples or min(1024, max(0, (split_tokens[index] - 1) // seq_len))
        for index, name in enumerate(SPLITS):
            if counts[name] <= 0:
                continue
            needed = BlendedDataset.samples_needed(self.weights, counts[name])
            parts = [
                GPTDataset(ds, r[index], seq_len, n, self.seed + index, name=f"{ds.prefix}[{name}]")
                for ds, r, n in zip(indexed, ranges, needed, strict=True)
            ]
            self.blends[name] = BlendedDataset(parts, self.weights, counts[name])
