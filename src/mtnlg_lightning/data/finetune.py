"""The fine-tuning data module: chat and instruction records -> the model's chat template -> examples masked to the
assistant's tokens -> rows of seq_len (packed by default) -> data-parallel step batches.

A sample is one row: `micro_batch_size` and `global_batch_size` count rows. Each batch carries `input_ids`,
`labels` (IGNORE_INDEX where not trained), `position_ids` (restarting at each document) and `document_ids` (the
document of each position, PADDING_DOCUMENT for padding: attention must stay within a document), beside the step's
`consumed_samples` and `global_batch_size` (see `data.packing` and `data.datamodule.StepBatches`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from mtnlg_lightning.data.chat_records import read_conversations
from mtnlg_lightning.data.chat_template import ChatTokenizer, EncodedChat, rendering_record
from mtnlg_lightning.data.datamodule import StepDataModule
from mtnlg_lightning.data.packing import Example, Rows, ShuffledRows, rows_batch
from mtnlg_lightning.errors import MTNLGError, is_rank_zero
from mtnlg_lightning.loss import IGNORE_INDEX

TRAIN_ON = ("assistant", "all")


def to_example(encoded: EncodedChat, seq_len: int) -> Example | None:
    """The example a conversation trains: its first `seq_len` tokens, each labelled with the next token of the same
    conversation where that token is trained. None when no label is left (the assistant's part lies beyond
    `seq_len`, or there is none)."""
    ids = np.asarray(encoded.ids, dtype=np.int64)
    trained = np.asarray(encoded.trained, dtype=bool)
    length = min(len(ids), seq_len)
    following, following_trained = ids[1 : length + 1], trained[1 : length + 1]
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    labels[: len(following)] = np.where(following_trained, following, IGNORE_INDEX)
    if not (labels != IGNORE_INDEX).any():
        return None
    return Example(ids[:length], labels)


@dataclass
class SplitExamples:
    examples: list[Example]
    dropped: Counter  # reason -> count
    read: int

    def each_example(self) -> list[Example]:
        return self.examples

    @property
    def left_out(self) -> Counter:
        return self.dropped

    def summary(self, name: str, seq_len: int) -> str | None:
        if not self.dropped:
            return None
        reasons = {
            "truncated": f"their assistant part lies beyond seq_len {seq_len}",
            "untrained": "no assistant turn",
        }
        parts = "; ".join(f"{n} {reasons[r]}" for r, n in sorted(self.dropped.items()))
        return f"fine-tuning data [{name}]: dropped {sum(self.dropped.values())} of {self.read} examples ({parts})"


def collect_samples(records, encode_one, specs, what: str) -> tuple[list, Counter, int]:
    """The samples `encode_one(where, record)` makes of `records` ((where, record) pairs), the reasons -> counts of
    those it leaves out (it returns a reason string for them), and how many records were read; no sample at all is
    an error naming `specs`."""
    samples, left_out, read = [], Counter(), 0
    for where, record in records:
        read += 1
        sample = encode_one(where, record)
        if isinstance(sample, str):
            left_out[sample] += 1
        else:
            samples.append(sample)
    if not samples:
        raise MTNLGError(f"{specs}: no {what} left to train on ({read} records read)")
    return samples, left_out, read


def encode_split(specs, chat: ChatTokenizer, seq_len: int, train_on: str) -> SplitExamples:
    """Every record of `specs` as an example; those with nothing left to train are dropped and counted."""

    def encode_one(where: str, messages: list[dict]) -> Example | str:
        with rendering_record(where):
            encoded = chat.encode(messages, train_on)
        example = to_example(encoded, seq_len)
        if example is None:
            return "untrained" if not any(encoded.trained) else "truncated"
        return example

    conversations = ((c.where, c.messages) for c in read_conversations(specs))
    return SplitExamples(*collect_samples(conversations, encode_one, specs, "example"))


class ChatDataModule(StepDataModule):
    """What the data modules of chat records share: their arguments, the model directory whose tokenizer and chat
    template render them (`data.tokenizer`, else the model's `init_from`), that tokenizer for the checkpoints, and
    the setup of each split (encode the records, check their ids against the vocabulary, report what was left out,
    draw the split's samples). A subclass says how a split is encoded (`encode`) and made into samples
    (`sample_set`)."""

    kind = "chat"  # the data's name in messages

    def __init__(
        self,
        train: str | list[str],
        valid: str | list[str] | None = None,
        tokenizer: str | None = None,
        chat_template: str | None = None,
        seed: int = 1234,
        num_workers: int = 0,
        eval_samples: int | None = None,
    ):
        """
        Args:
            train: the training records: files (JSON lines or a JSON array, plain, gzip or zstd; parquet), folders,
                globs or URLs, in the record forms the data module's description lists.
            valid: held-out records in the same forms (none: no validation).
            tokenizer: the model directory whose tokenizer.json and chat template encode the records (default: the
                model's `init_from`).
            chat_template: a template instead of the directory's: a name (chatml, llama3), a .jinja file, or the
                template text.
            seed: the seed of the sample order (each epoch its own permutation).
            num_workers: DataLoader worker processes.
            eval_samples: validation samples per evaluation (default: every one, whole global batches, at least one).
        """
        super().__init__()
        self.train, self.valid, self.tokenizer, self.chat_template = train, valid, tokenizer, chat_template
        self.seed, self.num_workers, self.eval_samples = seed, num_workers, eval_samples
        self.chat: ChatTokenizer | None = None
        self.left_out: dict[str, Counter] = {}  # split -> reason -> records not made into samples

    def _model_directory(self) -> str:
        directory = self.tokenizer
        if directory is None and self.trainer is not None:
            directory = self._module.hparams.get("init_from")
        if not directory:
            raise MTNLGError(
                f"{self.kind} data needs a model directory for its tokenizer and chat template: set "
                "data.tokenizer or model.init_from"
            )
        return directory

    @property
    def tokenizer_file(self) -> str | None:
        """The tokenizer.json of the data (copied into every checkpoint)."""
        return self.chat.tokenizer_file if self.chat is not None else None

    served = "sequences"  # what a sample is (`Objective.data_kind`)

    def check_objective(self) -> None:
        """Refuse a model objective this data cannot train, before the data is read."""
        self._module.objective.check_data(self)

    def encode(self, specs, seq_len: int):
        """The examples of one split: an object with `each_example()`, `left_out` (reason -> count) and
        `summary(name, seq_len)`."""
        raise NotImplementedError

    def sample_set(self, encoded, name: str, seq_len: int):
        """The split's samples, drawn `self.sample_count(name, available)` at a time."""
        raise NotImplementedError

    def sample_count(self, name: str, available: int) -> tuple[int, int]:
        """How many samples the split serves, and the seed of their order: training, those of `max_steps` steps
        (else one pass); validation, `eval_samples` (else every sample) in whole global batches, at least one."""
        schedule = self._module.batch_schedule
        if name == "train":
            max_steps = self.trainer.max_steps if self.trainer is not None else -1
            return (schedule.consumed_samples(max_steps) if max_steps and max_steps > 0 else available), self.seed
        count = self.eval_samples or available
        return max(schedule.global_batch_size, count - count % schedule.global_batch_size), self.seed + 1

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        self.check_objective()
        self.chat = ChatTokenizer(self._model_directory(), self.chat_template)
        seq_len, vocab = self._module.config.seq_len, self._module.config.padded_vocab_size()
        for name, specs in (("train", self.train), ("valid", self.valid)):
            if specs is None:
                continue
            encoded = self.encode(specs, seq_len)
            largest = max(int(e.input_ids.max()) for e in encoded.each_example())
            if largest >= vocab:
                raise MTNLGError(
                    f"{specs}: the tokenizer of {self.chat.directory} gives id {largest}, beyond the model's "
                    f"vocabulary {vocab}"
                )
            self.left_out[name] = encoded.left_out
            report = encoded.summary(name, seq_len)
            if report and is_rank_zero():
                print(report)
            self.splits[name] = self.sample_set(encoded, name, seq_len)


class FineTuneDataModule(ChatDataModule):
    """Chat and instruction records: `messages`, alpaca or `prompt` + `completion`; a sample is one row.

    The record forms are in data.chat_records; rows are packed (or one example each) to seq_len, and
    `eval_samples` counts rows."""

    kind = "fine-tuning"
    collate = staticmethod(rows_batch)

    def __init__(self, train_on: str = "assistant", pack: bool = True, **chat_records):
        """
        Args:
            train_on: `assistant` (the loss on what the assistant says, its end-of-turn token included) or `all`.
            pack: pack examples into rows by best-fit decreasing (documents masked from each other); false: one
                example per row, padded.
            **chat_records: the records and their template (train, valid, tokenizer, chat_template, seed,
                num_workers, eval_samples: see ChatDataModule).
        """
        super().__init__(**chat_records)
        if train_on not in TRAIN_ON:
            raise MTNLGError(f"data.train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        self.train_on, self.pack = train_on, pack

    @property
    def dropped(self) -> dict[str, Counter]:
        """Split -> reason -> conversations left with nothing to train."""
        return self.left_out

    def encode(self, specs, seq_len: int) -> SplitExamples:
        return encode_split(specs, self.chat, seq_len, self.train_on)

    def sample_set(self, encoded: SplitExamples, name: str, seq_len: int) -> ShuffledRows:
        build = Rows.packed if self.pack else Rows.one_per_row
        rows = build(encoded.examples, seq_len, self.chat.pad_id)
        return ShuffledRows(rows, *self.sample_count(name, len(rows)))
