"""The prompt data module (`--model.objective grpo`): records of a prompt and the columns its reward functions read
-> the prompt's token ids -> step batches of prompts, whose completions the objective generates and scores.

A record holds `prompt` in one of TRL's prompt-only forms:
- a string (standard form): the text as it is, tokenized as TRL's GRPOTrainer tokenizes it (`tokenizer(text)`: the
  special tokens the tokenizer.json's post-processor adds, such as Llama's bos, are added; no chat template);
- a list of turns, each `role` and `content` (conversational form): rendered with the model's chat template and the
  generation prompt after it (`apply_chat_template(prompt, add_generation_prompt=True)`'s ids); the completions are
  then handed to the reward functions as `[{"role": "assistant", "content": text}]`.

Every other field of a record (`answer`, `solution`, `tests`, ...) is a column, kept by name and handed to each reward
function as a keyword argument: a list aligned with the completions, None where a record lacks the field (every
batch of a split has every column of the split). `completion` and `completion_ids` are not columns (TRL drops them
too: the reward functions receive the generated ones).

A sample is one prompt: `micro_batch_size` and `global_batch_size` count prompts (the objective generates
`num_generations` completions of each). A prompt longer than the tokens `seq_len` leaves beside the completions (the
objective's `max_prompt_tokens(seq_len)`: seq_len less max_completion_length) is dropped and counted; a record
without a prompt, or with one in no known form, is one error line naming the record.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mtnlg_lightning.corpora.readers import iter_objects
from mtnlg_lightning.data.chat_records import _turns
from mtnlg_lightning.data.chat_template import ChatTokenizer, rendering_record
from mtnlg_lightning.data.finetune import ChatDataModule, SplitExamples, collect_samples
from mtnlg_lightning.data.packing import ShuffledRows
from mtnlg_lightning.errors import MTNLGError

PROMPT_FORMS = "a string, or a list of turns with role and content"
# Fields that are no column: the prompt itself, and what the reward functions get from the generation (as TRL).
NOT_COLUMNS = ("prompt", "completion", "completion_ids")
# The reward functions' own arguments beside completion_ids: no column may take their names.
REWARD_ARGUMENTS = ("prompts", "completions")


@dataclass
class PromptSample:
    ids: list[int]  # the prompt's token ids, as the model reads them before its completion
    prompt: str | list[dict]  # the record's prompt (its turns read as `role` and `content`)
    columns: dict  # column -> this record's value (None where it lacks the field)

    @property
    def input_ids(self) -> np.ndarray:
        """The ids as an array (the data module checks them against the model's vocabulary)."""
        return np.asarray(self.ids, dtype=np.int64)


def to_prompt(record: dict, where: str) -> str | list[dict]:
    """The prompt a record holds; one MTNLGError line naming the record otherwise."""
    if "prompt" not in record:
        seen = ", ".join(sorted(map(str, record))) or "none"
        raise MTNLGError(f"{where}: a prompt record needs prompt ({PROMPT_FORMS}; fields: {seen})")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise MTNLGError(f"{where}: prompt is {type(prompt).__name__}, expected {PROMPT_FORMS}")
    turns = _turns(prompt, where, "prompt")
    for turn in turns:
        if "content" not in turn:
            raise MTNLGError(
                f"{where}: a prompt turn has fields {', '.join(sorted(map(str, turn)))}; expected role and content"
            )
    return turns


def prompt_ids(chat: ChatTokenizer, prompt: str | list[dict]) -> list[int]:
    """The ids the model reads before its completion: a string tokenized as it is (with the tokenizer's own special
    tokens), turns rendered with the chat template and its generation prompt."""
    if isinstance(prompt, str):
        return list(chat.tokenizer.encode(prompt).ids)
    return chat.prompt_ids(prompt)


@dataclass
class PromptExamples(SplitExamples):
    """A split's prompt samples (`examples`), the reasons -> counts of those dropped and how many records were read."""

    max_prompt_tokens: int = 0  # the longest prompt kept

    def summary(self, name: str, seq_len: int) -> str | None:
        if not self.dropped:
            return None
        count = sum(self.dropped.values())  # all "long"
        return (
            f"prompt data [{name}]: dropped {count} of {self.read} prompts ({count} longer than the "
            f"{self.max_prompt_tokens} tokens seq_len {seq_len} leaves beside the completions)"
        )


def encode_prompts(specs, chat: ChatTokenizer, max_prompt_tokens: int) -> PromptExamples:
    """Every record of `specs` as a prompt sample; those longer than `max_prompt_tokens` are dropped and counted.
    Every sample carries every column of the split (None where its record lacks one)."""

    def encode_one(where: str, record: dict) -> PromptSample | str:
        prompt = to_prompt(record, where)
        with rendering_record(where):
            ids = prompt_ids(chat, prompt)
        if not ids:
            raise MTNLGError(f"{where}: the prompt is empty (no tokens to generate from)")
        if len(ids) > max_prompt_tokens:
            return "long"
        taken = [field for field in REWARD_ARGUMENTS if field in record]
        if taken:
            raise MTNLGError(f"{where}: a field named {taken[0]} would hide the reward functions' own; rename it")
        return PromptSample(ids, prompt, {k: v for k, v in record.items() if k not in NOT_COLUMNS})

    records = iter_objects([specs] if isinstance(specs, str) else list(specs))
    samples, dropped, read = collect_samples(records, encode_one, specs, "prompt")
    names = list(dict.fromkeys(name for sample in samples for name in sample.columns))
    for sample in samples:
        sample.columns = {name: sample.columns.get(name) for name in names}
    return PromptExamples(samples, dropped, read, max_prompt_tokens)


def prompts_batch(samples: Sequence[PromptSample]) -> dict:
    """A rank's prompts as the objective generates from them: `prompt_ids` (a list of lists of ints, unpadded),
    `prompt_tokens` (their lengths, a LongTensor [P]), `prompts` (each record's prompt: a string or a list of turns)
    and `columns` (column -> list of P values, None where a record lacks the column). Lightning moves the tensor to the
    device and hands the lists on as they are."""
    names = list(dict.fromkeys(name for sample in samples for name in sample.columns))
    return {
        "prompt_ids": [list(sample.ids) for sample in samples],
        "prompt_tokens": torch.tensor([len(sample.ids) for sample in samples], dtype=torch.long),
        "prompts": [sample.prompt for sample in samples],
        "columns": {name: [sample.columns.get(name) for sample in samples] for name in names},
    }


class PromptDataModule(ChatDataModule):
    """Prompts for reinforcement learning from reward functions: records of `prompt` (a string or a list of turns)
    and the columns the reward functions read; a sample is one prompt.

    The record forms are in this module's description; the prompt budget is seq_len less the objective's
    max_completion_length, and `eval_samples` counts prompts."""

    kind = "prompt"
    served = "prompts"
    objective_hint = "set model.objective grpo (or --config grpo)"
    collate = staticmethod(prompts_batch)

    @property
    def dropped(self) -> dict[str, Counter]:
        """Split -> reason -> prompts not served (`long`: beyond the prompt budget)."""
        return self.left_out

    def encode(self, specs, seq_len: int) -> PromptExamples:
        return encode_prompts(specs, self.chat, self._module.objective.max_prompt_tokens(seq_len))

    def sample_set(self, encoded: PromptExamples, name: str, seq_len: int) -> ShuffledRows | RepeatedBatches:
        samples = ShuffledRows(encoded.examples, *self.sample_count(name, len(encoded.examples)))
        repeats = self._module.objective.batch_repeats if name == "train" else 1
        if repeats == 1:
            return samples
        schedule = self._module.batch_schedule
        if schedule.rampup_start is not None:
            raise MTNLGError(
                "model.grpo num_iterations > 1 serves each global batch of prompts several times, which a batch "
                "ramp-up would cut differently: drop the ramp-up or use num_iterations 1"
            )
        return RepeatedBatches(samples, schedule.global_batch_size, repeats)


class RepeatedBatches:
    """The samples of `samples` served a global batch at a time, each global batch `repeats` times in a row (TRL's
    RepeatSampler with `repeat_count` num_iterations): steps k x repeats ... (k + 1) x repeats - 1 serve global batch
    k. As many samples as `samples` holds (the steps' count is unchanged); fewer distinct prompts are read."""

    def __init__(self, samples: ShuffledRows, global_batch_size: int, repeats: int):
        self.samples, self.global_batch_size, self.repeats = samples, global_batch_size, repeats

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        step, at = divmod(index, self.global_batch_size)
        return self.samples[(step // self.repeats) * self.global_batch_size + at]
