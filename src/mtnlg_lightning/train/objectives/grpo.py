"""GRPO (`--model.objective grpo`, `--config grpo`): each step samples `num_generations` completions of every prompt
with the policy (`rollouts.LayoutGenerator`), scores them with the reward functions (`rewards`), turns the rewards
into group-relative advantages and trains on the completions with the clipped objective (`grpo_loss`, TRL 1.16's
arithmetic), through the same step path as language modelling (`runner.forward_backward`: one process, DDP, TP,
PP, ZeRO).

A sample is one prompt: a rank's batch holds its prompts. Each becomes one row (`rollouts.shared_prompt_rows`):
the prompt computed once and its G completions as branches of it, each attending to the prompt and itself only, so
the prompt's positions are not trained G times (TRL computes G rows of prompt + completion). A pipeline's schedule
runs fixed shapes, which such a row (up to the prompt + G completions long) does not keep: there, and with
`share_prompts: false`, each completion is a row of its own (prompt + completion, `rollouts.completion_rows`), its G
rows next to each other. A micro-batch holds `micro_batch_size` prompts' rows, so a group never straddles
micro-batches or ranks. Either way the loss lays each position's values out per completion (`CompletionSlots`), so
the advantages, the reference's, the sampler's and the old log-probs are kept per completion token [completions,
max_completion_length] whatever the rows (and a checkpoint's are the same in every layout). As DPO does, each row's
target is its labels with one more column, its index in the rank's rows, by which the loss finds its completions'
values however the runner cuts the batch (the pipeline hands the last stage each micro-batch's targets).

The loss of a micro-batch is its share of the loss of the whole global batch (`grpo_loss.loss_of`, with the step's
completion and sequence counts summed over the world, as `loss.StepLoss` counts labels), times micro-batches x world
size: after the runner's division by the micro-batches and the replicas' gradient average, the step's gradient is the
one of the whole batch in one process, in any layout. The rewards are gathered over the data-parallel replicas before
the advantages (TRL gathers them too), so `scale_rewards: batch` and the logged statistics are the global batch's.

The reference (beta > 0): the base with its adapters off under LoRA, else a frozen copy of the starting weights taken
when the layout is applied (`preference.ReferenceWeights`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.grpo_loss import (
    GRPOConfig,
    group_advantages,
    loss_of,
    metric_means,
    metric_sums,
    per_token_losses,
    reward_metrics,
    sequence_sums,
)
from mtnlg_lightning.loss import IGNORE_INDEX
from mtnlg_lightning.parallel.lora import adapters_disabled
from mtnlg_lightning.rewards import RewardFunctions, load_rewards, score
from mtnlg_lightning.train.objectives.objective import Objective
from mtnlg_lightning.train.objectives.preference import (
    ReferenceWeights,
    logits_of,
    split_target,
    token_scoring,
    with_row_index,
)
from mtnlg_lightning.train.objectives.rollouts import (
    ROW_TOKENS,
    CompletionSlots,
    LayoutGenerator,
    completion_rows,
    completion_seeds,
    per_completion,
    shared_prompt_row_length,
    shared_prompt_rows,
)

ROW_MULTIPLE = 64  # rows are padded to a multiple of this (`GRPO._row_width`), not to seq_len
GENERATION_STATE = "grpo_generation"  # a checkpoint's generation inside its num_iterations (see GRPO.state_dict)
METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
# the sampler's log-probabilities against the trained ones on the sampled tokens (TRL's names): the ratio is 1.0 in
# fp32 when nothing changed the weights in between (a health check of the generation path)
SAMPLING_METRICS = ("sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/mean")


class TokenScores:
    """(output, labels) -> each completion token's log-probability at the sampling temperature, in the run's layout:
    vocabulary-parallel under TP (`per_token` of the layout's loss); under CP the logits are this rank's chunks of
    each row, so the labels are cut alike and per-row sums are added over the ranks (`sum_over_sequence`)."""

    def __init__(self, loss_fn, temperature: float):
        self.temperature = temperature
        self.context, self.output = token_scoring(loss_fn)

    def mine(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's positions of whole-row values [B, S]."""
        return self.context.chunk_of(full) if self.context is not None else full

    def sum_over_sequence(self, per_row: torch.Tensor) -> torch.Tensor:
        return self.context.sum_over_sequence(per_row) if self.context is not None else per_row

    def logps(self, output, labels: torch.Tensor) -> torch.Tensor:
        return -self.output.per_token(logits_of(output), labels, self.temperature)

    def entropy(self, output, labels: torch.Tensor) -> torch.Tensor:
        """The entropy [B, S] of the sampling distribution where the label is a completion token (0 elsewhere),
        over the whole vocabulary under TP."""
        return self.output.entropy(logits_of(output), labels, self.temperature)


class TokenLogps:
    """A forward-only 'loss' that records each completion token's log-probability ([completions, T], per completion
    as `CompletionSlots` lays them out; on the ranks that compute the loss) and contributes nothing: the reference
    pass, and the old policy's."""

    def __init__(self, scores: TokenScores, slots: torch.Tensor, branches: int, longest: int, device):
        self.scores, self.slots, self.branches, self.longest = scores, slots, branches, longest
        self.logps = torch.zeros(len(slots) * branches, longest, dtype=torch.float32, device=device)

    def __call__(self, output, target: torch.Tensor) -> torch.Tensor:
        labels, rows = split_target(target)
        slots = CompletionSlots(self.scores.mine(self.slots[rows]), self.branches, self.longest)
        logps = slots.spread(self.scores.logps(output, self.scores.mine(labels)).detach().float())
        if self.scores.context is not None:  # each completion token lies in one rank's chunk: the ranks' sum
            dist.all_reduce(logps, group=self.scores.context.group)
        self.logps[slots.completions(rows)] = logps
        return logps.new_zeros(())


class GRPOLoss:
    """A micro-batch's GRPO loss (see the module docstring), and the metric sums it adds to `totals`."""

    def __init__(self, config: GRPOConfig, scores: TokenScores, rows: dict, counts, scale: float):
        self.config, self.scores = config, scores
        # per completion of the rank's batch: advantages [C]; reference and sampling log-probs [C, T] (or None)
        self.advantages, self.reference, self.sampling = rows["advantages"], rows["reference"], rows["sampling"]
        self.old = rows["old"]  # the generating policy's log-probs (num_iterations > 1), or None: the policy's own
        self.slots, self.branches = rows["slots"], rows["branches"]  # where the rows' completion tokens lie
        self.global_sequences, self.global_tokens = counts
        self.scale = scale  # micro-batches x world size
        device = self.advantages.device
        self.totals = {name: torch.zeros(2, dtype=torch.float64, device=device) for name in METRICS + SAMPLING_METRICS}

    def __call__(self, output, target: torch.Tensor) -> torch.Tensor:
        labels, rows = split_target(target)
        mine = self.scores.mine(labels)
        slots = CompletionSlots(self.scores.mine(self.slots[rows]), self.branches, self.config.max_completion_length)
        completions = slots.completions(rows)
        mask = slots.spread(mine.ne(IGNORE_INDEX))
        logp = slots.spread(self.scores.logps(output, mine))
        reference = self.reference[completions] if self.reference is not None else None
        old = self.old[completions] if self.old is not None else None
        losses, parts = per_token_losses(logp, old, reference, self.advantages[completions], mask, self.config)
        sums, tokens = sequence_sums(losses, mask)
        sums, tokens = self.scores.sum_over_sequence(sums), self.scores.sum_over_sequence(tokens)
        entropy = slots.spread(self.scores.entropy(output, mine))
        for name, total in metric_sums(parts, mask, entropy).items():
            self.totals[name] += total.to(self.totals[name].device)
        if self.sampling is not None:
            gap = (logp.detach() - self.sampling[completions]).masked_fill(~mask, 0.0).double()
            counted = mask.sum().double()
            ratio = torch.exp(gap).masked_fill(~mask, 0.0).sum()
            self.totals[SAMPLING_METRICS[0]] += torch.stack([ratio, counted])
            self.totals[SAMPLING_METRICS[1]] += torch.stack([gap.abs().sum(), counted])
        share = loss_of(sums, tokens, self.config, self.global_sequences, self.global_tokens)
        return share * self.scale


@dataclass
class Generated:
    """One generation's batch as the loss reads it: the prompts it came from, the rows with their row-index targets,
    the per-row values (advantages [R]; reference, sampling and old log-probs [R, S] or None), the global batch's
    completion and token counts, the generation's metrics and its seconds."""

    prompt_ids: list[list[int]]
    targeted: dict[str, torch.Tensor]
    per_row: dict[str, torch.Tensor | None]
    counts: tuple[torch.Tensor, torch.Tensor]
    metrics: dict[str, float]
    seconds: float
    completions: list[list[int]]  # this rank's completions and whether each ended on its own
    ended: list[bool]
    rewards: torch.Tensor  # the global batch's [rows, functions]


class GRPO(Objective):
    """Settings: the module's `grpo` (a mapping with TRL's names: `grpo_loss.GRPOConfig`), `rewards` and
    `reward_weights` (`rewards.load_rewards`)."""

    name = "grpo"
    data_kind = "prompts"
    data_hint = "prompt records (data.PromptDataModule: --config grpo)"

    def __init__(self, config: GRPOConfig, rewards: RewardFunctions):
        self.config, self.rewards = config, rewards
        self.sequences_per_sample = config.num_generations  # a prompt's G rows (tokens per second, FLOPs)
        self.batch_repeats = config.num_iterations  # mu steps train on each generated batch
        self.reference_weights: ReferenceWeights | None = None
        self.seed = 0
        self.metrics: dict[str, float | torch.Tensor] = {}
        self.completions: list[list[int]] = []  # this rank's completions of the last step, G per prompt
        self.shown: list[dict] = []  # a few of them as text, with their rewards (the completions table)
        self.end_of_turn = None  # the chat template's end-of-turn marker, and the generator stopping at it: set
        self.generator: LayoutGenerator | None = None  # when the fit starts (the data module brings the template)
        self.scores_rewards = True
        self.replica_of_rank: list[int] = []  # set when the fit starts
        self.first_of_replica: dict[int, int] = {}
        self.generated: Generated | None = None  # num_iterations > 1: the batch the next iterations train on again
        self.resumed: dict | None = None  # the generation a checkpoint kept (`state_dict`), until a step takes it
        self.trained_rows: dict | None = None  # the rows the last training step ran (its tokens and FLOPs)

    @classmethod
    def from_hparams(cls, hparams: Mapping) -> GRPO:
        config = GRPOConfig.from_mapping(hparams.get("grpo"))
        if not hparams.get("rewards"):
            raise MTNLGError("model.objective grpo needs model.rewards: reward functions, e.g. [accuracy, format]")
        return cls(config, load_rewards(hparams.get("rewards"), hparams.get("reward_weights")))

    def max_prompt_tokens(self, seq_len: int) -> int:
        """The longest prompt that leaves room for a whole completion in a row of `seq_len` (the data drops longer
        ones)."""
        room = seq_len - self.config.max_completion_length
        if room < 1:
            raise MTNLGError(
                f"model.grpo max_completion_length {self.config.max_completion_length} leaves no room for a prompt "
                f"in seq_len {seq_len}: lower it or raise seq_len"
            )
        return room

    def samples_in(self, batch: dict) -> int:
        return len(batch["prompt_ids"])

    def computed_rows(self, batch: dict) -> dict:
        return self.trained_rows  # the data's batch holds the prompts: the rows are the step's completions

    def document_tokens(self, rows: dict) -> int:
        if rows.get(ROW_TOKENS) is not None:  # a row per completion; shared rows mark their padding by document
            return int(rows[ROW_TOKENS].sum())
        return super().document_tokens(rows)

    def check_layout(self, module, strategy) -> None:
        if self.config.beta and not module.frozen_base and getattr(strategy, "zero_stage", 0) >= 3:
            raise MTNLGError(
                "full-weight GRPO with beta > 0 under ZeRO-3 keeps no reference copy: use LoRA (the reference is "
                "the base with its adapters off), beta 0, or zero_stage 1 or 2"
            )

    def on_layout_applied(self, module) -> None:
        if self.config.beta and not module.frozen_base and self.reference_weights is None:
            self.reference_weights = ReferenceWeights(module.model)

    def on_fit_start(self, module) -> None:
        self.seed = torch.initial_seed()  # the run's seed (the same on every rank): the sampling seeds' root
        chat = module.trainer.datamodule.chat
        self.end_of_turn = chat.end_of_turn()
        self.generator = self._generator(chat, self.end_of_turn)
        # each global rank's data-parallel replica, and the first rank of each (in global rank order): the one whose
        # rows count when every rank's are gathered, and the one that runs the rewards
        dp_rank, _ = module.trainer.datamodule.data_parallel_rank_and_size()
        self.replica_of_rank = [dp_rank]
        if module.trainer.world_size > 1:
            mine = torch.tensor(dp_rank, device=module.device)
            self.replica_of_rank = module.trainer.strategy.all_gather(mine).tolist()
        self.first_of_replica = {r: self.replica_of_rank.index(r) for r in sorted(set(self.replica_of_rank))}
        self.scores_rewards = self.first_of_replica[dp_rank] == module.trainer.global_rank

    # ---------------------------------------------------------------------------------------------- the step
    def forward_backward(self, module, batch: dict) -> torch.Tensor:
        return self._step(module, batch, train=True)

    def evaluate(self, module, batch: dict) -> torch.Tensor:
        return self._step(module, batch, train=False)

    @staticmethod
    def _generator(chat, end) -> LayoutGenerator:
        """The project's decoder, stopping at the template's end of turn (its token ids, or its text where this
        tokenizer spells the marker as several tokens)."""
        texts = end.texts
        window = max((len(t.encode("utf-8")) for t in texts), default=0) + 2

        def ends_in_text(tokens: list[int]) -> bool:
            return bool(texts) and end.ends(chat.decode(tokens[-window:]))

        return LayoutGenerator(end.ids, ends_in_text if texts else None)

    def _step(self, module, batch: dict, train: bool) -> torch.Tensor:
        """Generate, score and train on this batch's prompts; with num_iterations mu > 1, a training step whose
        number is not a multiple of mu trains again on the last generated batch (the data serves each global batch
        of prompts mu times in a row, as TRL's RepeatSampler), against the log-probs its policy had when it was
        generated (`old`)."""
        if self.generator is None:  # a validation outside a fit
            self.on_fit_start(module)
        mu = self.config.num_iterations
        reuse = train and mu > 1 and module.trainer.global_step % mu != 0 and self.generated is not None
        if reuse and self.generated.prompt_ids != batch["prompt_ids"]:
            raise MTNLGError(
                "GRPO num_iterations > 1 trains again on the last generated batch, but the data served other "
                "prompts (a resume inside a generation's iterations): resume from a step that is a multiple of "
                f"num_iterations {mu}"
            )
        if train and mu > 1 and module.trainer.global_step % mu and self.generated is None and self.resumed:
            self.generated, reuse = self._resumed_generation(module, batch), True
        elif train and mu > 1 and module.trainer.global_step % mu and self.generated is None:
            rank_zero_warn(
                f"GRPO resumed at step {module.trainer.global_step}, inside a generation's num_iterations {mu}, from "
                "a checkpoint without its generated batch: this step generates afresh from the same prompts"
            )
        generated = self.generated if reuse else self._generate(module, batch, train)
        if train:  # a validation between the iterations leaves the training generation in place
            self.generated = generated if mu > 1 else None
            self.trained_rows = generated.targeted
        started = time.perf_counter()
        config, G = self.config, self.config.num_generations
        per_micro_batch = module.micro_batch_size * G // generated.per_row["branches"]  # rows
        scores = TokenScores(module.loss_fn, config.temperature)
        rows = len(generated.targeted["labels"])
        scale = float(-(-rows // per_micro_batch) * module.trainer.world_size)  # micro-batches x world size
        grpo_loss = GRPOLoss(config, scores, generated.per_row, generated.counts, scale)
        run = module.runner.forward_backward if train else module.runner.evaluate
        loss = run(generated.targeted, per_micro_batch, module.layout_loss(grpo_loss))  # + the extensions' terms
        self.metrics = {**generated.metrics, **self._loss_metrics(module, grpo_loss)}
        self.metrics["timing/generation_s"] = 0.0 if reuse else generated.seconds
        self.metrics["timing/training_s"] = time.perf_counter() - started
        # the micro-batches' mean of their scaled shares: this rank's part of the global batch's loss x world
        # size, whose mean over the ranks (the logged value) is the global batch's loss
        return loss

    def _generate(self, module, batch: dict, train: bool) -> Generated:
        """This rank's completions of its prompts, their rewards, the rows and per-row values the loss reads."""
        config, G = self.config, self.config.num_generations
        data = module.trainer.datamodule
        prompts = batch["prompt_ids"]
        dp_rank, _ = data.data_parallel_rank_and_size()
        first = int(batch["consumed_samples"]) + dp_rank * len(prompts)  # this rank's first prompt in the stream
        repeated = [p for p in prompts for _ in range(G)]
        seeds = completion_seeds(self.seed, first if train else -1 - first, len(prompts), G)
        rollouts = self.generator.generate(module, repeated, seeds, config)
        started = time.perf_counter()
        if train:  # the training generation's, which a validation in between leaves in place
            self.completions = rollouts.ids
        everyone = self._scored_over_replicas(module, batch, rollouts)
        local = slice(dp_rank * len(repeated), (dp_rank + 1) * len(repeated))
        if train:
            self.shown = self._table_rows(batch, rollouts, everyone[local].cpu(), data.chat)
        sampling = None
        if rollouts.logprobs is not None:
            sampling = per_completion(rollouts.logprobs, config.max_completion_length).to(module.device)
        old = None if train and config.num_iterations > 1 else False  # to compute (mu > 1), or none (mu = 1)
        generated = self._batch_of(module, prompts, rollouts.ids, rollouts.ended, everyone, old, sampling)
        generated.metrics.update(self._rollout_metrics(module, rollouts, generated.metrics.pop("stats")))
        generated.metrics["timing/scoring_s"] = time.perf_counter() - started
        generated.seconds = rollouts.seconds
        return generated

    def _shares_prompts(self, module) -> bool:
        """Whether a prompt's completions train as branches of one row (`shared_prompt_rows`): unless a pipeline
        runs the step (its schedule's fixed shapes are seq_len) or `share_prompts` is off."""
        return self.config.share_prompts and getattr(module.trainer.strategy, "pipeline", None) is None

    def _row_width(self, module, prompts, completions) -> int:
        """The width the rows are padded to: the global batch's longest row (a prompt + its completion, or a
        prompt with its G completions where they share it) rounded up to a multiple of 64 (which sequence and context
        parallelism's cuts divide), one row of a completion at most seq_len; the same in every layout (a maximum over
        every rank). A pipeline's schedule runs fixed shapes: seq_len there."""
        limit, G = module.config.seq_len, self.config.num_generations
        if getattr(module.trainer.strategy, "pipeline", None) is not None:
            return limit
        if self._shares_prompts(module):
            groups = range(len(prompts) // G)
            longest = max(shared_prompt_row_length(prompts[g * G], completions[g * G : (g + 1) * G]) for g in groups)
        else:
            longest = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
        longest = torch.tensor(longest)
        if module.trainer.world_size > 1:
            longest = module.trainer.strategy.reduce(longest.to(module.device), reduce_op="max")
        width = -(-int(longest) // ROW_MULTIPLE) * ROW_MULTIPLE
        return width if self._shares_prompts(module) else min(limit, width)

    def _batch_of(self, module, prompts, completions, ended, everyone, old=False, sampling=None) -> Generated:
        """The rows this rank trains on from its prompts' `completions` (G each, with whether each `ended`) and the
        global batch's rewards `everyone`: the advantages, the reference's log-probs (beta > 0), and `old`: the
        policy's log-probs as they are now when None (num_iterations > 1: later iterations' ratios are taken
        against them, TRL's old_per_token_logps), given ones (a resumed generation's), or none (False: mu = 1
        trains on the policy that sampled, the ratio is exactly 1)."""
        config, G = self.config, self.config.num_generations
        data = module.trainer.datamodule
        dp_rank, _ = data.data_parallel_rank_and_size()
        repeated = [p for p in prompts for _ in range(G)]
        local = slice(dp_rank * len(repeated), (dp_rank + 1) * len(repeated))
        width, longest = self._row_width(module, repeated, completions), config.max_completion_length
        if self._shares_prompts(module):  # a row per prompt, its completions branches of it
            branches, rows = G, shared_prompt_rows(prompts, completions, width, data.chat.pad_id, longest)
        else:  # a row per completion
            branches, rows = 1, completion_rows(repeated, completions, width, data.chat.pad_id)
        self.sequences_per_sample = G // branches  # a prompt's rows (the step's computed positions and FLOPs)
        slots = rows.pop("slots")
        if config.mask_truncated_completions:
            completion = torch.arange(len(slots))[:, None] * branches + slots.clamp(min=0) // longest
            truncated = ~torch.tensor(ended)[completion]
            rows["labels"][(slots >= 0) & truncated] = IGNORE_INDEX
        rows = {name: value.to(module.device) for name, value in rows.items()}
        slots = slots.to(module.device)
        advantages, stats = group_advantages(everyone, self.rewards.weights.to(module.device), G, config.scale_rewards)
        targeted = {**rows, "labels": with_row_index(rows["labels"])}
        per_micro_batch = module.micro_batch_size * G // branches
        scores = TokenScores(module.loss_fn, config.temperature)
        layout = (slots, branches)
        reference = None
        if config.beta:
            reference = self._logps(module, targeted, layout, per_micro_batch, scores, reference=True)
        if old is None:
            old = self._logps(module, targeted, layout, per_micro_batch, scores)
        counts = module.trainer.strategy.reduce(
            torch.tensor([float(len(repeated)), float(rows["labels"].ne(IGNORE_INDEX).sum())], device=module.device),
            reduce_op="sum",
        )
        per_row = {"advantages": advantages[local], "reference": reference, "sampling": sampling}
        per_row |= {"old": None if old is False else old, "slots": slots, "branches": branches}
        return Generated(
            list(prompts), targeted, per_row, (counts[0], counts[1]), {"stats": stats}, 0.0, list(completions),
            list(ended), everyone,
        )  # fmt: skip

    # ------------------------------------------------------------------------ a generation across a checkpoint
    def state_dict(self, module) -> dict:
        """Inside a generation's num_iterations (mu > 1, the next step trains on it again): the global batch's
        completions, rewards, the generating policy's log-probs and the generation's metrics, gathered from every
        replica (a collective: every rank saves), so a resume in any layout trains the next iterations on the same
        rows against the same log-probs."""
        kept, mu = self.generated, self.config.num_iterations
        if kept is None or mu == 1 or module.trainer.global_step % mu == 0:  # the next step generates anew
            return {}
        if module.trainer.world_size == 1:
            return {GENERATION_STATE: {"completions": kept.completions, "ended": kept.ended,
                                       "rewards": kept.rewards.cpu(), "old": kept.per_row["old"].cpu(),
                                       "metrics": kept.metrics}}  # fmt: skip
        everyone = [None] * module.trainer.world_size
        dist.all_gather_object(everyone, (kept.completions, kept.ended))
        firsts = [everyone[first] for first in self.first_of_replica.values()]
        old = module.trainer.strategy.all_gather(kept.per_row["old"])  # [world, completions, T]
        replicas = self.replica_of_rank
        # the ranks that computed the rows' log-probs (a pipeline's last stage) hold them, the others zeros
        chosen = [max((i for i, r in enumerate(replicas) if r == d), key=lambda i: float(old[i].abs().sum()))
                  for d in self.first_of_replica]  # fmt: skip
        return {
            GENERATION_STATE: {
                "completions": [ids for completions, _ in firsts for ids in completions],
                "ended": [e for _, ended in firsts for e in ended],
                "rewards": kept.rewards.cpu(),
                "old": torch.cat([old[i] for i in chosen]).cpu(),
                "metrics": kept.metrics,
            }
        }

    def load_state_dict(self, module, checkpoint: dict) -> None:
        self.resumed = checkpoint.get(GENERATION_STATE)

    def _resumed_generation(self, module, batch: dict) -> Generated:
        """The generation a checkpoint kept, as this rank's rows in this run's layout."""
        state, self.resumed = self.resumed, None
        dp_rank, _ = module.trainer.datamodule.data_parallel_rank_and_size()
        rows = len(batch["prompt_ids"]) * self.config.num_generations
        local = slice(dp_rank * rows, (dp_rank + 1) * rows)
        old = state["old"][local].to(module.device)
        everyone = state["rewards"].to(module.device)
        completions, prompts = state["completions"][local], batch["prompt_ids"]
        generated = self._batch_of(module, prompts, completions, state["ended"][local], everyone, old)
        generated.metrics = dict(state["metrics"])
        self.completions = generated.completions
        return generated

    def _scored_over_replicas(self, module, batch: dict, rollouts) -> torch.Tensor:
        """[rows of the global batch, functions]: the rewards of every replica's completions, in replica order. One
        rank of each replica runs the reward functions (the others of its TP, PP and CP groups hold the same
        completions: a reward that runs tests or calls a service runs once per completion); a failure there stops
        every rank with its one-line message."""
        rows, functions = len(rollouts.ids), len(self.rewards.names)
        local = torch.full((rows, functions + 1), float("nan"), dtype=torch.float32)  # + a column: it failed
        failure = None
        if self.scores_rewards:
            try:
                local[:, :functions] = self._rewards(batch, rollouts, module.trainer.datamodule.chat)
                local[:, functions] = 0.0
            except MTNLGError as error:
                failure, local[:, functions] = str(error), 1.0
        everyone = self._over_replicas(module, local.to(module.device))
        if bool((everyone[:, functions] == 1.0).any()):
            if module.trainer.world_size > 1:  # every rank says what failed, on whichever replica
                messages = [None] * module.trainer.world_size
                dist.all_gather_object(messages, failure)
                failure = next(m for m in messages if m is not None)
            raise MTNLGError(failure)
        return everyone[:, :functions]

    def _rewards(self, batch: dict, rollouts, chat) -> torch.Tensor:
        G = self.config.num_generations
        prompts = [p for p in batch["prompts"] for _ in range(G)]
        # what the turn says, as TRL's decode with skip_special_tokens gives it: an end-of-turn marker that this
        # tokenizer spells as text (ChatML's on a tokenizer without it) cut off too
        end = self.end_of_turn
        texts = [end.cut(chat.tokenizer.decode(list(ids), skip_special_tokens=True)) for ids in rollouts.ids]
        completions = [
            [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
            for prompt, text in zip(prompts, texts, strict=True)
        ]
        columns = {name: [v for v in values for _ in range(G)] for name, values in batch["columns"].items()}
        return score(self.rewards.functions, prompts, completions, rollouts.ids, columns)

    def _table_rows(self, batch: dict, rollouts, rewards: torch.Tensor, chat, prompts: int = 2) -> list[dict]:
        """The first `prompts` prompts of this rank with each of their completions and rewards, as text."""
        G, rows = self.config.num_generations, []
        for p, prompt in enumerate(batch["prompts"][:prompts]):
            for g in range(G):
                i = p * G + g
                values = dict(zip(self.rewards.names, rewards[i].tolist(), strict=True))
                text = prompt if isinstance(prompt, str) else chat.render(prompt, add_generation_prompt=True)
                rows.append({"prompt": text, "completion": chat.decode(rollouts.ids[i]), **values})
        return rows

    def _log_table(self, module) -> None:
        """Every `log_completions_every_n_steps` steps, on global rank 0: a few prompts with their completions and
        rewards, appended to `completions.jsonl` in the run's log folder and, with a wandb logger, as a table."""
        every, step = self.config.log_completions_every_n_steps, module.trainer.global_step
        if not every or step % every or not module.trainer.is_global_zero or not self.shown:
            return
        folder = Path(module.trainer.log_dir or module.trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "completions.jsonl", "a", encoding="utf-8") as handle:
            for row in self.shown:
                handle.write(json.dumps({"step": step, **row}) + "\n")
        for logger in module.trainer.loggers:
            if hasattr(logger, "log_table"):  # WandbLogger
                columns = list(self.shown[0])
                logger.log_table("completions", columns=columns, data=[list(row.values()) for row in self.shown])

    def _over_replicas(self, module, local: torch.Tensor) -> torch.Tensor:
        """Every data-parallel replica's rows of `local`, in replica order (the ranks of one replica hold the
        same rows: the first of them counts)."""
        if module.trainer.world_size == 1:
            return local
        gathered = module.trainer.strategy.all_gather(local)
        return torch.cat([gathered[first] for first in self.first_of_replica.values()])

    def _logps(self, module, batch: dict, layout, rows_per_micro_batch: int, scores: TokenScores, reference=False):
        """[completions, T]: each completion token's log-probability under the policy as it is now, or under the
        reference (the base with its adapters off under LoRA, else the frozen starting weights), in eval mode (no
        dropout) and without autograd state. `layout`: the rows' (slots, completions per row)."""
        slots, branches = layout
        collector = TokenLogps(scores, slots, branches, self.config.max_completion_length, module.device)
        swapped = nullcontext(module.model)
        if reference and module.frozen_base:
            swapped = adapters_disabled(module.model)
        elif reference and self.reference_weights is not None:
            swapped = self.reference_weights.swapped_into(module.model)
        training = module.model.training
        module.model.eval()
        try:
            with torch.no_grad(), swapped:
                module.runner.evaluate(batch, rows_per_micro_batch, collector)
        finally:
            module.model.train(training)
        return collector.logps

    def _rollout_metrics(self, module, rollouts, stats) -> dict:
        """TRL's names for the rewards' statistics (the global batch's) and the completions' lengths."""
        out = reward_metrics(stats, self.rewards.names)
        lengths = torch.tensor([len(ids) for ids in rollouts.ids], dtype=torch.float64, device=module.device)
        clipped = torch.tensor([not e for e in rollouts.ended], dtype=torch.float64, device=module.device)
        lengths, clipped = self._over_replicas(module, lengths), self._over_replicas(module, clipped)
        out["completions/mean_length"] = float(lengths.mean())
        out["completions/min_length"] = float(lengths.min())
        out["completions/max_length"] = float(lengths.max())
        out["completions/clipped_ratio"] = float(clipped.mean())
        return out

    def _loss_metrics(self, module, loss_fn: GRPOLoss) -> dict:
        """The loss's means under TRL's names (kl, entropy, clip ratios, the sampling ratio): one all-reduce of
        their sums."""
        names = [name for name in METRICS + SAMPLING_METRICS if name != "kl" or self.config.beta]
        totals = torch.stack([loss_fn.totals[name] for name in names])
        totals = module.trainer.strategy.reduce(totals, reduce_op="sum")
        return {name: float(value) for name, value in metric_means(dict(zip(names, totals, strict=True))).items()}

    def log_metrics(self, module, prefix: str = "") -> None:
        for name, value in self.metrics.items():
            module.log(f"{prefix}{name}", float(value))
        if not prefix:
            self._log_table(module)
