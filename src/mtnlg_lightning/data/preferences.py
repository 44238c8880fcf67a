"""The preference data module (`--model.objective dpo`): records of a prompt and a chosen and a rejected answer ->
the model's chat template -> two rows per pair, each labelled on its completion tokens only -> step batches.

A record is one of (the forms TRL's preference datasets take):
- `prompt` (a string: one user turn; or a list of turns) with `chosen` and `rejected` (strings: one assistant turn
  each; or lists of turns);
- `messages` (the shared conversation, a list of turns) with `chosen` and `rejected`;
- `chosen` and `rejected` alone, as whole conversations: the turns they share from the start are the prompt.

A sample is one pair: `micro_batch_size` and `global_batch_size` count pairs. A rank's batch holds the pair's chosen
row at 2i and its rejected row at 2i + 1 (`pairs_batch`). Rows are not packed: each is one sequence, padded to
`seq_len` (attention is causal, so the padding after a sequence never reaches it), which keeps every sequence's
log-probability exact in every layout. A completion longer than what `seq_len` leaves after the prompt is cut (its
kept tokens are scored); a pair whose chosen and rejected are the same is skipped and counted; a prompt that leaves
no room for a completion is one error line naming the record.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mtnlg_lightning.corpora.readers import iter_objects
from mtnlg_lightning.data.chat_records import _turns
from mtnlg_lightning.data.chat_template import ChatTokenizer, EncodedChat, rendering_record
from mtnlg_lightning.data.finetune import ChatDataModule, collect_samples, to_example
from mtnlg_lightning.data.packing import (
    GROUP_LENGTHS,
    PADDING_DOCUMENT,
    ROW_LENGTHS,
    Example,
    ShuffledRows,
    assemble_row,
)
from mtnlg_lightning.errors import MTNLGError

# One sequence a row, padding after it: plain causal attention is exact, no document ids are needed.
PAIR_FIELDS = ("input_ids", "labels", "position_ids")
# A row's summed completion log-probability under the reference model, when the data brings it
# (`data.precompute_reference`): a batch field [rows], float32.
REFERENCE_LOGPS = "reference_logps"
PREFERENCE_FORMS = "prompt (or messages) + chosen + rejected, or chosen + rejected as whole conversations"


@dataclass
class PreferencePair:
    prompt: list[dict]  # the shared conversation, ending before the answers
    chosen: list[dict]  # the preferred answer's turns
    rejected: list[dict]
    where: str  # FILE:LINE, for messages about this record


def _answer(value, where: str, field: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    return _turns(value, where, field)


def to_pair(record: dict, where: str) -> PreferencePair:
    """The pair a record holds; one MTNLGError line naming the record and the fields seen otherwise."""
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        seen = ", ".join(sorted(map(str, record))) if isinstance(record, dict) else type(record).__name__
        raise MTNLGError(f"{where}: a preference record needs chosen and rejected (fields: {seen or 'none'})")
    prompt = record.get("prompt", record.get("messages"))
    if prompt is not None:
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _turns(prompt, where, "prompt")
        return PreferencePair(
            turns,
            _answer(record["chosen"], where, "chosen"),
            _answer(record["rejected"], where, "rejected"),
            where,
        )
    if isinstance(record["chosen"], str) or isinstance(record["rejected"], str):
        raise MTNLGError(
            f"{where}: chosen and rejected are plain text but the record has no prompt ({PREFERENCE_FORMS})"
        )
    chosen, rejected = _turns(record["chosen"], where, "chosen"), _turns(record["rejected"], where, "rejected")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0 or shared == len(chosen) or shared == len(rejected):
        raise MTNLGError(
            f"{where}: chosen and rejected as conversations must share their first turns (the prompt) and differ after"
        )
    return PreferencePair(chosen[:shared], chosen[shared:], rejected[shared:], where)


def encode_completion(chat: ChatTokenizer, prompt: list[dict], answer: list[dict]) -> tuple[EncodedChat, int]:
    """The conversation prompt + answer with only the answer's assistant tokens trained (its end-of-turn token
    included), and how many tokens the prompt takes (rendered with the generation prompt)."""
    encoded = chat.encode(prompt + answer, "assistant")
    prefix = chat.tokenizer.encode(chat.render(prompt, add_generation_prompt=True), add_special_tokens=False).ids
    prompt_tokens = len(prefix)
    # An assistant turn inside the shared prompt is not part of the answer: only what follows the prompt trains.
    trained = [flag and i >= prompt_tokens for i, flag in enumerate(encoded.trained)]
    return EncodedChat(encoded.ids, trained), prompt_tokens


@dataclass
class PairExamples:
    pairs: list[tuple[Example, Example]]
    skipped: Counter  # reason -> count
    read: int

    def each_example(self) -> list[Example]:
        return [example for pair in self.pairs for example in pair]

    @property
    def left_out(self) -> Counter:
        return self.skipped

    def summary(self, name: str, seq_len: int | None = None) -> str | None:
        if not self.skipped:
            return None
        reasons = {"identical": "chosen equal to rejected", "untrained": "no assistant tokens in an answer"}
        parts = "; ".join(f"{n} {reasons[r]}" for r, n in sorted(self.skipped.items()))
        return f"preference data [{name}]: skipped {sum(self.skipped.values())} of {self.read} pairs ({parts})"


def encode_pairs(specs, chat: ChatTokenizer, seq_len: int) -> PairExamples:
    """Every record of `specs` as a (chosen, rejected) pair of examples."""

    def encode_one(where: str, record: dict) -> tuple[Example, Example] | str:
        pair = to_pair(record, where)
        with rendering_record(where):
            (chosen, prompt_tokens), (rejected, _) = (
                encode_completion(chat, pair.prompt, answer) for answer in (pair.chosen, pair.rejected)
            )
        if prompt_tokens >= seq_len:
            raise MTNLGError(
                f"{where}: the prompt takes {prompt_tokens} tokens, leaving no room for an answer in seq_len "
                f"{seq_len} (shorten it or raise seq_len)"
            )
        if chosen.ids == rejected.ids:
            return "identical"
        examples = to_example(chosen, seq_len), to_example(rejected, seq_len)
        return "untrained" if None in examples else examples

    records = iter_objects([specs] if isinstance(specs, str) else list(specs))
    return PairExamples(*collect_samples(records, encode_one, specs, "preference pair"))


def pair_rows(pair: tuple[Example, Example], seq_len: int, pad_id: int) -> list[dict[str, np.ndarray]]:
    """A pair's chosen and rejected rows (`data.packing.assemble_row`, one sequence each)."""
    return [assemble_row([example], seq_len, pad_id) for example in pair]


class PairRows(ShuffledRows):
    """`count` pairs drawn epoch by epoch as `ShuffledRows` draws fine-tuning rows; a pair is its chosen and its
    rejected row, each with its reference log-probability once the run has computed them (`reference`: [2 x pairs],
    pair i's chosen at 2i and rejected at 2i + 1)."""

    def __init__(self, pairs: Sequence[tuple[Example, Example]], count: int, seq_len: int, pad_id: int, seed: int):
        super().__init__(pairs, count, seed)
        self.pairs, self.seq_len, self.pad_id = pairs, seq_len, pad_id
        self.reference: np.ndarray | None = None

    def __getitem__(self, index: int) -> list[dict[str, np.ndarray]]:
        pair = self.source_index(index)
        rows = pair_rows(self.pairs[pair], self.seq_len, self.pad_id)
        if self.reference is not None:
            for side, row in enumerate(rows):
                row[REFERENCE_LOGPS] = self.reference[2 * pair + side]
        return rows


def pairs_batch(pairs: Sequence[list[dict[str, np.ndarray]]]) -> dict[str, torch.Tensor]:
    """Pairs stacked into rows [2P, seq_len], the chosen row of pair i at 2i and its rejected row at 2i + 1 (and
    their reference log-probabilities [2P] when the rows carry them), with each row's length (ROW_LENGTHS: a layout
    that may change shapes computes a micro-batch up to its longest row) and its pair's (GROUP_LENGTHS: a pair stays
    whole and in order when micro-batches are grouped by length)."""
    rows = [row for pair in pairs for row in pair]
    fields = [*PAIR_FIELDS, REFERENCE_LOGPS] if REFERENCE_LOGPS in rows[0] else PAIR_FIELDS
    batch = {field: torch.from_numpy(np.stack([row[field] for row in rows])) for field in fields}
    lengths = torch.tensor([int((row["document_ids"] != PADDING_DOCUMENT).sum()) for row in rows])
    batch[ROW_LENGTHS] = lengths
    batch[GROUP_LENGTHS] = lengths.view(-1, 2).amax(dim=1).repeat_interleave(2)
    return batch


class PreferenceDataModule(ChatDataModule):
    """Preference pairs: records of `prompt` (or `messages`), `chosen` and `rejected`; a sample is one pair.

    The record forms are in this module's description; `eval_samples` counts pairs, and validation logs val_loss
    and the rewards of the held-out pairs."""

    kind = "preference"
    served = "pairs"
    objective_hint = "set model.objective dpo (or --config dpo)"
    collate = staticmethod(pairs_batch)

    def __init__(self, precompute_reference: bool = False, **chat_records):
        """
        Args:
            precompute_reference: full-weight DPO without a reference copy in memory: before the first step, every
                pair's reference log-probabilities are computed with the starting weights in the run's layout, kept
                with the data and saved in each checkpoint (a resumed run reads them back). Runs full-weight DPO
                under ZeRO-3. (With LoRA the reference is the base with the adapters off: nothing to precompute.)
            **chat_records: the records and their template (train, valid, tokenizer, chat_template, seed,
                num_workers, eval_samples: see ChatDataModule).
        """
        super().__init__(**chat_records)
        self.precompute_reference = precompute_reference

    def reference_pairs(self) -> dict[str, Sequence[tuple[Example, Example]]]:
        """Each split's distinct pairs, in record order: what the reference log-probabilities are indexed by."""
        return {name: rows.pairs for name, rows in self.splits.items()}

    def reference_tables(self) -> dict[str, np.ndarray]:
        """Split -> [2 x pairs] reference log-probabilities, for the splits that have them."""
        return {name: rows.reference for name, rows in self.splits.items() if rows.reference is not None}

    def set_reference_tables(self, tables: dict[str, np.ndarray]) -> None:
        for name, table in tables.items():
            rows = self.splits.get(name)
            if rows is None or table.shape != (2 * len(rows.pairs),):
                raise MTNLGError(
                    f"the reference log-probabilities of the {name} split are for {len(table) // 2} pairs; the data "
                    f"has {len(rows.pairs) if rows is not None else 0} (not the data this run started with?)"
                )
            rows.reference = np.asarray(table, dtype=np.float32)

    @property
    def skipped(self) -> dict[str, Counter]:
        """Split -> reason -> records not made into pairs (chosen equal to rejected, no assistant tokens)."""
        return self.left_out

    def encode(self, specs, seq_len: int) -> PairExamples:
        return encode_pairs(specs, self.chat, seq_len)

    def sample_set(self, encoded: PairExamples, name: str, seq_len: int) -> PairRows:
        count, seed = self.sample_count(name, len(encoded.pairs))
        return PairRows(encoded.pairs, count, seq_len, self.chat.pad_id, seed)
