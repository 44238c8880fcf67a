"""Generation inside the training loop (GRPO's rollouts): a `Generator` continues each prompt of this rank's batch
`num_generations` times with the policy's current weights, and `completion_rows` turns prompts and completions into
the rows the step trains on.

One `Generator` today: `LayoutGenerator`, the project's own KV-cache decoder (`inference.decode.generate_batch`) in
the run's layout (one process; each replica of Lightning's DDP; TP x PP x EP under the 3D strategy, through
`ShardedModel.from_strategy`), in eval mode and without autograd state. A vLLM engine would be a second
implementation of the same method (docs/how-to/reinforcement-learning.md says how it would plug in).

Each completion samples from its own generator, seeded from the run's seed and the completion's place in the data
stream (its prompt's sample number x G + its index in the group): the completions depend neither on the layout, nor
on the rank, nor on a resume.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from mtnlg_lightning.data.packing import PADDING_DOCUMENT
from mtnlg_lightning.inference.decode import generate_batch, sequence_seed
from mtnlg_lightning.inference.sampling import EOS
from mtnlg_lightning.inference.sharded_model import ShardedModel
from mtnlg_lightning.loss import IGNORE_INDEX
from mtnlg_lightning.model import branch_document

# [R]: a row of one completion's positions before its padding, what `tokens_per_sec` counts. Not ROW_LENGTHS, which
# would have the runner regroup and cut the rows: GRPO sizes its rows itself (`GRPO._row_width`).
ROW_TOKENS = "row_tokens"


@dataclass
class Rollouts:
    """This rank's completions, G per prompt, contiguous per prompt: their ids (an end token included where the
    completion ended on one), whether each ended on its own (not cut at max_completion_length or the position
    limit), the seconds the generation took, and each token's log-probability as the sampler saw it (on the last
    pipeline stage's ranks; None elsewhere)."""

    ids: list[list[int]]
    ended: list[bool]
    seconds: float
    logprobs: list[list[float]] | None = None


class Generator:
    """Continues prompts with the policy; every rank of a replica calls it with the same prompts."""

    def generate(self, module, prompts: Sequence[Sequence[int]], seeds: Sequence[int], settings) -> Rollouts:
        raise NotImplementedError


class LayoutGenerator(Generator):
    """The project's decoder in the training layout: `end_ids` and `end_texts` end a completion (the template's end
    of turn, the eos token), which keeps its end token."""

    def __init__(self, end_ids: Sequence[int], end_text=None):
        self.end_ids, self.end_text = set(end_ids), end_text

    def _stops(self, tokens: list[int]) -> bool:
        return tokens[-1] in self.end_ids or (self.end_text is not None and self.end_text(tokens))

    def generate(self, module, prompts, seeds, settings) -> Rollouts:
        started = time.perf_counter()
        strategy = module.trainer.strategy
        if hasattr(strategy, "groups"):  # the 3D strategy: this rank's stages, TP shards and experts, set to decode
            decoding = ShardedModel.decoding(strategy)
        else:  # one process, or a DDP replica: the whole model
            decoding = nullcontext(ShardedModel.whole(module.model))
        limit = module.config.seq_len
        new_tokens = min(settings.max_completion_length, limit - min(len(p) for p in prompts))
        training = module.model.training
        module.model.eval()  # no dropout while sampling (the policy's distribution itself)
        try:
            with decoding as model, GenerationProgress(module.trainer, new_tokens) as progress:
                batch = generate_batch(
                    model,
                    [list(p) for p in prompts],
                    max_new_tokens=new_tokens,
                    temperature=settings.temperature,
                    top_k=settings.top_k,
                    top_p=settings.top_p,
                    seeds=list(seeds),
                    on_token=progress.on_token,
                    stop_text=self._stops,
                )
        finally:
            module.model.train(training)
        ids, ended = [], []
        for prompt, tokens, stop in zip(prompts, batch.tokens, batch.stop, strict=True):
            room = min(settings.max_completion_length, limit - len(prompt))
            ids.append(tokens[:room])
            ended.append(stop == EOS and len(tokens) <= room)
        logprobs = None
        if batch.logprobs is not None:
            logprobs = [values[: len(kept)] for values, kept in zip(batch.logprobs, ids, strict=True)]
        return Rollouts(ids, ended, time.perf_counter() - started, logprobs)


class GenerationProgress:
    """A progress bar of the step's generation on global rank 0 (beside Lightning's, gone when it ends), counting the
    new tokens of the longest completion so far against the most it may make; none where the trainer shows no
    progress bar."""

    def __init__(self, trainer, total: int):
        self.shown = trainer.is_global_zero and trainer.progress_bar_callback is not None
        self.total, self.made, self.bar = total, 0, None

    def __enter__(self) -> GenerationProgress:
        if self.shown:
            from tqdm import tqdm  # Lightning's own bar's dependency

            self.bar = tqdm(total=self.total, desc="Generating", unit="tok", leave=False, dynamic_ncols=True)
        return self

    def on_token(self, index: int, tokens: list[int]) -> None:
        if self.bar is not None and len(tokens) > self.made:
            self.bar.update(len(tokens) - self.made)
            self.made = len(tokens)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def completion_seeds(seed: int, first_sample: int, prompts: int, generations: int) -> list[int]:
    """The seeds of `prompts` x `generations` completions whose first prompt is sample `first_sample` of the data
    stream: completion g of sample s samples with `sequence_seed(seed, s x G + g)`."""
    return [
        sequence_seed(seed, (first_sample + p) * generations + g) for p in range(prompts) for g in range(generations)
    ]


def completion_rows(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], seq_len: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """The rows the step trains on, one per completion, padded on the right to `seq_len`: `input_ids` (prompt then
    completion), `labels` (each completion token at the position that predicts it; IGNORE_INDEX elsewhere),
    `position_ids`, `slots` (`CompletionSlots`: token t of the row's completion at its label's position) and
    ROW_TOKENS (each row's positions before its padding)."""
    rows = len(prompts)
    input_ids = torch.full((rows, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.long)
    slots = torch.full((rows, seq_len), -1, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        tokens = [*prompt, *completion][:seq_len]
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        n = len(tokens) - len(prompt)
        if n > 0:
            labels[row, len(prompt) - 1 : len(prompt) - 1 + n] = torch.tensor(tokens[len(prompt) :])
            slots[row, len(prompt) - 1 : len(prompt) - 1 + n] = torch.arange(n)
    positions = torch.arange(seq_len).expand(rows, seq_len).contiguous()
    lengths = torch.tensor([min(seq_len, len(p) + len(c)) for p, c in zip(prompts, completions, strict=True)])
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions, "slots": slots, ROW_TOKENS: lengths}


def shared_prompt_row_length(prompt: Sequence[int], completions: Sequence[Sequence[int]]) -> int:
    """The positions `shared_prompt_rows` gives a prompt and its completions: the prompt less its last token once,
    then each completion's tokens (the first input of each branch is the prompt's last token, the last completion
    token is only a label)."""
    return len(prompt) - 1 + sum(len(c) for c in completions)


def shared_prompt_rows(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], width: int, pad_id: int, longest: int
) -> dict[str, torch.Tensor]:
    """The rows the step trains on, one per prompt with its completions (len(completions) / len(prompts) each,
    contiguous per prompt), padded on the right to `width`: the prompt's tokens but its last, computed once, then
    each completion as a branch of it (`model.branch_document`: it sees the prompt and itself, not its siblings),
    the prompt's last token then the completion's, at the positions the completion has after its prompt. A
    completion's log-probabilities are those of `completion_rows`' row of it; the prompt's positions are computed
    once instead of G times. `slots` (`CompletionSlots`): token t of branch j at j x `longest` + t (`longest`: the
    most tokens a completion may have)."""
    G = len(completions) // len(prompts)
    rows = len(prompts)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((rows, width), dtype=torch.long)
    documents = torch.full((rows, width), PADDING_DOCUMENT, dtype=torch.long)
    slots = torch.full((rows, width), -1, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        p = len(prompt) - 1
        input_ids[row, :p] = torch.tensor(prompt[:p], dtype=torch.long)
        positions[row, :p] = torch.arange(p)
        documents[row, :p] = 0
        at = p
        for j, completion in enumerate(completions[row * G : (row + 1) * G]):
            n = len(completion)
            if n == 0:
                continue
            span = slice(at, at + n)
            input_ids[row, span] = torch.tensor([prompt[-1], *completion[:-1]], dtype=torch.long)
            labels[row, span] = torch.tensor(list(completion), dtype=torch.long)
            positions[row, span] = torch.arange(p, p + n)
            documents[row, span] = branch_document(0, j)
            slots[row, span] = j * longest + torch.arange(n)
            at += n
        positions[row, at:] = torch.arange(width - at)  # the padding: positions of its own, as a packed row's
    return {
        "input_ids": input_ids, "labels": labels, "position_ids": positions, "document_ids": documents,
        "slots": slots,
    }  # fmt: skip


class CompletionSlots:
    """Where each completion token of a micro-batch's rows lies: `slots` [b, S] (this rank's positions of them: CP
    cuts the rows into chunks) holds j x T + t at the position whose label is token t of the row's completion j, -1
    elsewhere; each row holds `branches` completions (G with `shared_prompt_rows`, 1 with `completion_rows`) of at
    most T tokens. `spread` lays a per-position tensor out per completion, [b x branches, T] (zero where a completion
    has no token, or where its token lies in another rank's chunk), which the loss reads whatever the rows."""

    def __init__(self, slots: torch.Tensor, branches: int, longest: int):
        self.branches, self.longest = branches, longest
        self.index = torch.where(slots >= 0, slots, branches * longest)  # the others to a dropped last column

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(values.shape[0], self.branches * self.longest + 1)
        out = out.scatter(1, self.index, values)
        return out[:, :-1].reshape(-1, self.longest)

    def completions(self, rows: torch.Tensor) -> torch.Tensor:
        """The indices among the rank's completions of the rows' completions, in `spread`'s order."""
        return (rows[:, None] * self.branches + torch.arange(self.branches, device=rows.device)).flatten()


def per_completion(values: Sequence[Sequence[float]], longest: int) -> torch.Tensor:
    """[completions, longest] fp32: each completion token's value (its sampling log-probability), 0 past its end."""
    out = torch.zeros(len(values), longest, dtype=torch.float32)
    for row, row_values in enumerate(values):
        n = min(len(row_values), longest)
        if n:
            out[row, :n] = torch.tensor(row_values[:n], dtype=torch.float32)
    return out
