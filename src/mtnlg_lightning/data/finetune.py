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
from mtnlg_lightning.data.chat_template import ChatTokenizer, EncodedChat
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

    def summary(self, name: str, seq_len: int) -> str | None:
        if not self.dropped:
            return None
        reasons = {
            "truncated": f"their assistant part lies beyond seq_len {seq_len}",
            "untrained": "no assistant turn",
        }
        parts = "; ".join(f"{n} {reasons[r]}" for r, n in sorted(self.dropped.items()))
        return f"fine-tuning data [{name}]: dropped {sum(self.dropped.values())} of {self.read} examples ({parts})"


def encode_split(specs, chat: ChatTokenizer, seq_len: int, train_on: str) -> SplitExamples:
    """Every record of `specs` as an example; those with nothing left to train are dropped and counted."""
    examples, dropped, read = [], Counter(), 0
    for conversation in read_conversations(specs):
        read += 1
        try:
            encoded = chat.encode(conversation.messages, train_on)
        except MTNLGError:
            raise
        except Exception as error:  # jinja2's errors, raise_exception's messages, a template's TypeError
            message = " ".join(str(error).split()) or type(error).__name__
            raise MTNLGError(f"{conversation.where}: the chat template fails on this record: {message}") from None
        example = to_example(encoded, seq_len)
        if example is None:
            dropped["untrained" if not any(encoded.trained) else "truncated"] += 1
            continue
        examples.append(example)
    if not examples:
        raise MTNLGError(f"{specs}: no example left to train on ({read} records read)")
    return SplitExamples(examples, dropped, read)


class ChatDataModule(StepDataModule):
    """What the data modules of chat records share: the model directory whose tokenizer and chat template render
    them (`data.tokenizer`, else the model's `init_from`), and that tokenizer for the checkpoints."""

    kind = "chat"  # the data's name in messages
    tokenizer: str | None = None
    chat: ChatTokenizer | None = None

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


class FineTuneDataModule(ChatDataModule):
    kind = "fine-tuning"
    collate = staticmethod(rows_batch)

    def __init__(
        self,
        train: str | list[str],
        valid: str | list[str] | None = None,
        tokenizer: str | None = None,
        chat_template: str | None = None,
        train_on: str = "assistant",
        pack: bool = True,
        seed: int = 1234,
        num_workers: int = 0,
        eval_samples: int | None = None,
    ):
        """
        Args:
            train: the training records: files (JSON lines or a JSON array, plain, gzip or zstd; parquet), folders,
                globs or URLs; each record `messages`, alpaca (`instruction`, `input`, `output`) or `prompt` and
                `completion` (see data.chat_records).
            valid: the validation records, in the same forms (none: no validation).
            tokenizer: the model directory whose tokenizer.json and chat template encode the records (default: the
                model's `init_from`).
            chat_template: a template instead of the directory's: a name (chatml, llama3), a .jinja file, or the
                template text.
            train_on: `assistant` (the loss on what the assistant says, its end-of-turn token included) or `all`.
            pack: pack examples into rows by best-fit decreasing (documents masked from each other); false: one
                example per row, padded.
            seed: the seed of the row order (each epoch its own permutation).
            num_workers: DataLoader worker processes.
            eval_samples: validation rows per evaluation (default: every row, whole global batches, at least one).
        """
        super().__init__()
        if train_on not in TRAIN_ON:
            raise MTNLGError(f"data.train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        self.train, self.valid, self.tokenizer = train, valid, tokenizer
        self.chat_template, self.train_on, self.pack, self.seed = chat_template, train_on, pack, seed
        self.num_workers, self.eval_samples = num_workers, eval_samples
        self.chat: ChatTokenizer | None = None
        self.dropped: dict[str, Counter] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        self.chat = ChatTokenizer(self._model_directory(), self.chat_template)
        module = self._module
        seq_len, vocab = module.config.seq_len, module.config.padded_vocab_size()
        global_batch = module.batch_schedule.global_batch_size
        for name, specs in (("train", self.train), ("valid", self.valid)):
            if specs is None:
                continue
            split = encode_split(specs, self.chat, seq_len, self.train_on)
            largest = max(int(e.input_ids.max()) for e in split.examples)
            if largest >= vocab:
                raise MTNLGError(
                    f"{specs}: the tokenizer of {self.chat.directory} gives id {largest}, beyond the model's "
                    f"vocabulary {vocab}"
                )
            self.dropped[name] = split.dropped
            report = split.summary(name, seq_len)
            if report and is_rank_zero():
                print(report)
            build = Rows.packed if self.pack else Rows.one_per_row
            rows = build(split.examples, seq_len, self.chat.pad_id)
            if name == "train":
                max_steps = self.trainer.max_steps if self.trainer is not None else -1
                count = module.batch_schedule.consumed_samples(max_steps) if max_steps and max_steps > 0 else len(rows)
                self.splits[name] = ShuffledRows(rows, count, self.seed)
            else:
                count = self.eval_samples or len(rows)
                count = max(global_batch, count - count % global_batch)
                self.splits[name] = ShuffledRows(rows, count, self.seed + 1)
