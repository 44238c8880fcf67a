"""The preference objective (`--model.objective dpo`): the reference pass, then the policy's forward and backward
through the same step path as language modelling (`runner.forward_backward`: one process, TP, PP, ZeRO).

A sample is one pair: a rank's batch holds its pairs as interleaved rows (chosen, rejected, ...), and a micro-batch
holds `2 x micro_batch_size` rows, so a pair never straddles micro-batches or ranks.

Each row's target is its labels with one more column, the row's index in the rank's batch: however the batch is cut
into micro-batches (the accumulation loop, the pipeline schedule, which hands the last stage each micro-batch's
targets), the loss finds each row's reference log-probability by that index.

The reference model:
- with LoRA, the base: the same modules with their adapters off (`parallel.lora.adapters_disabled`);
- with full weights, a frozen copy of this rank's shards, taken once the layout is applied and before a checkpoint
  is restored (`ReferenceWeights`: the starting weights, on a resume too), swapped in for the reference pass only;
- or, with `data.precompute_reference`, log-probs computed once before the first step with the starting weights in
  the run's layout (`Preference.on_fit_start`: no copy, so full weights run under ZeRO-3 too), which the data
  then brings (`reference_logps` in the batch) and every checkpoint keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from mtnlg_lightning.data.preferences import REFERENCE_LOGPS, pair_rows, pairs_batch
from mtnlg_lightning.dpo_loss import DPOConfig, PairRewards, pair_losses, sequence_logps
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.parallel.context_parallel import ContextParallelLoss
from mtnlg_lightning.parallel.lora import adapters_disabled
from mtnlg_lightning.parallel.output_layer import OutputLoss
from mtnlg_lightning.train.objectives.objective import Objective

REFERENCE_STATE = "dpo_reference_logps"  # the checkpoint's precomputed reference log-probs, split -> [2 x pairs]


def with_row_index(labels: torch.Tensor) -> torch.Tensor:
    """[R, S] labels -> [R, S + 1] targets: each row's labels, then its index in the batch."""
    rows = torch.arange(len(labels), device=labels.device, dtype=labels.dtype)
    return torch.cat([labels, rows[:, None]], dim=1)


def split_target(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return target[:, :-1], target[:, -1]


def token_scoring(loss_fn):
    """The parts of a layout's micro-batch loss (`module.loss_fn`) that score single tokens, for an objective that
    scores tokens itself: (CP's `ContextParallelLoss` or None, the layout's `OutputLoss`: the head inside the loss,
    vocabulary-parallel under TP, in chunks; without one, the scorer of whole logits). The extensions' wrappers (the
    router losses) hold the loss they wrap as `loss_fn` and are looked through."""
    while loss_fn is not None and not isinstance(loss_fn, OutputLoss | ContextParallelLoss):
        loss_fn = getattr(loss_fn, "loss_fn", None)
    context = loss_fn if isinstance(loss_fn, ContextParallelLoss) else None
    inner = context.loss_fn if context is not None else loss_fn
    return context, inner if isinstance(inner, OutputLoss) else OutputLoss()  # None: logits of a plain model


def logits_of(output) -> torch.Tensor:
    """The logits of a forward's output: a mixture of experts' last pipeline stage adds its router totals."""
    return output[0] if isinstance(output, tuple) else output


class SequenceScores:
    """(output, labels) -> each row's summed completion log-probability and its counted tokens, [R] each, in the
    run's layout (`token_scoring`): vocabulary-parallel under TP; under CP the logits are this rank's chunks of each
    row, so the labels are cut alike and the ranks' parts added (`ContextParallelLoss.sum_over_sequence`)."""

    def __init__(self, loss_fn=None):
        self.context, self.output = token_scoring(loss_fn)

    def __call__(self, output, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits_of(output)
        if self.context is None:
            return sequence_logps(self.output.per_token(logits, labels), labels)
        mine = self.context.chunk_of(labels)
        logps, tokens = sequence_logps(self.output.per_token(logits, mine), mine)
        return self.context.sum_over_sequence(logps), self.context.sum_over_sequence(tokens)


class ReferenceLogps:
    """A forward-only 'loss' that records each row's summed completion log-probability (on the ranks that compute
    the loss: every rank, or the last pipeline stage) and contributes nothing."""

    def __init__(self, scores, rows: int, device):
        self.scores = scores
        self.logps = torch.zeros(rows, dtype=torch.float32, device=device)
        self.seen = torch.zeros(rows, dtype=torch.bool, device=device)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, rows = split_target(target)
        logps, _ = self.scores(logits, labels)
        self.logps[rows], self.seen[rows] = logps.detach().float(), True
        return logps.new_zeros(())


class PreferenceLoss:
    """A micro-batch's DPO/IPO loss: the mean over its pairs (every micro-batch holds as many pairs, so the step's
    mean over micro-batches and data-parallel replicas is the mean over the global batch's pairs)."""

    def __init__(self, config: DPOConfig, scores, reference: torch.Tensor, rewards: PairRewards):
        self.config, self.scores, self.reference, self.rewards = config, scores, reference, rewards

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, rows = split_target(target)
        policy, tokens = self.scores(logits, labels)
        losses, chosen, rejected = pair_losses(self.config, policy, self.reference[rows], tokens)
        self.rewards.record(rows[0::2] // 2, chosen, rejected)  # a pair's chosen row is 2i
        return losses.mean()


def reference_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What the reference copies: every parameter, and a last pipeline stage's copy of a tied embedding (a plain
    tensor that the tie refreshes each step, `parallel.tied_embedding`)."""
    tensors = list(model.parameters())
    for module in model.modules():
        head = getattr(module, "lm_head", None)
        if head is not None and not isinstance(head.weight, nn.Parameter):
            tensors.append(head.weight)
    return tensors


class ReferenceWeights:
    """A frozen copy of this rank's weights, sharded as the policy is (same tensors, same shapes)."""

    def __init__(self, model: nn.Module):
        with torch.no_grad():
            self.copies = [tensor.detach().clone() for tensor in reference_tensors(model)]

    @contextmanager
    def swapped_into(self, model: nn.Module):
        tensors = reference_tensors(model)
        if [t.shape for t in tensors] != [c.shape for c in self.copies]:
            raise MTNLGError("the DPO reference copy no longer matches the model's shards")
        # Taken where the model was built; the strategy may have moved or cast it since.
        self.copies = [copy.to(tensor.device, tensor.dtype) for tensor, copy in zip(tensors, self.copies, strict=True)]
        policy = [tensor.data for tensor in tensors]
        try:
            for tensor, copy in zip(tensors, self.copies, strict=True):
                tensor.data = copy
            yield model
        finally:
            for tensor, data in zip(tensors, policy, strict=True):
                tensor.data = data


def precomputing(module) -> bool:
    """Whether the run's data brings the reference log-probabilities (`data.precompute_reference`): full weights
    only; under LoRA the reference is the base with the adapters off, nothing to precompute."""
    return not module.frozen_base and bool(getattr(module.trainer.datamodule, "precompute_reference", False))


class Preference(Objective):
    """DPO / IPO on pairs: `forward_backward` and `evaluate` as the runner's, on pairs; the rewards logged after.
    Settings: the module's `dpo_beta`, `dpo_loss`, `dpo_label_smoothing` (`dpo_loss.DPOConfig`)."""

    name = "dpo"
    data_kind = "pairs"
    data_hint = "preference records (data.PreferenceDataModule: --config dpo)"
    sequences_per_sample = 2  # a chosen and a rejected sequence (the reference's forward is not counted)

    def __init__(self, config: DPOConfig):
        self.config = config
        self.reference_weights: ReferenceWeights | None = None
        self.rewards: PairRewards | None = None

    @classmethod
    def from_hparams(cls, hparams: Mapping) -> Preference:
        return cls(DPOConfig(hparams["dpo_beta"], hparams["dpo_loss"], hparams["dpo_label_smoothing"]))

    def on_layout_applied(self, module) -> None:
        """Full-weight DPO: the reference is the model as its layout holds it before a checkpoint is restored into
        it or any update (the starting weights, on a resume too); none is kept when the data brings its log-probs."""
        if not module.frozen_base and self.reference_weights is None and not precomputing(module):
            self.reference_weights = ReferenceWeights(module.model)

    def check_layout(self, module, strategy) -> None:
        if not module.frozen_base and getattr(strategy, "zero_stage", 0) >= 3 and not precomputing(module):
            raise MTNLGError(
                "full-weight DPO under ZeRO-3 keeps no reference copy: set data.precompute_reference true, or use "
                "LoRA, or zero_stage 1 or 2"
            )

    def on_fit_start(self, module) -> None:
        """Before the first step of a run (the model holds its starting weights), with `data.precompute_reference`:
        every pair's reference log-probabilities, computed in the run's layout a global batch of pairs at a time
        (this data-parallel rank its share, as a step's batch), then summed over the ranks that computed each row
        and divided by their count, so that every rank holds the whole table. Nothing to do when the data has its
        tables already (restored from a checkpoint)."""
        data = module.trainer.datamodule
        if not precomputing(module) or data.reference_tables():
            return
        dp_rank, dp_size = data.data_parallel_rank_and_size()
        global_pairs = module.batch_schedule.global_batch_size
        local, rows = global_pairs // dp_size, 2 * module.micro_batch_size
        seq_len = module.config.seq_len
        tables = {}
        for name, pairs in data.reference_pairs().items():
            sums = torch.zeros(2 * len(pairs), dtype=torch.float64, device=module.device)
            counts = torch.zeros_like(sums)
            for consumed in range(0, len(pairs), global_pairs):
                indices = [(consumed + dp_rank * local + i) % len(pairs) for i in range(local)]
                batch = pairs_batch([pair_rows(pairs[i], seq_len, data.chat.pad_id) for i in indices])
                batch = {field: value.to(module.device) for field, value in batch.items()}
                collector = self._reference_pass(module, {**batch, "labels": with_row_index(batch["labels"])}, rows)
                at = torch.tensor([2 * i + side for i in indices for side in (0, 1)], device=module.device)
                sums.index_add_(0, at, collector.logps.double())  # 0 on the rows this rank did not score
                counts.index_add_(0, at, collector.seen.double())
            totals = module.trainer.strategy.reduce(torch.stack([sums, counts]), reduce_op="sum")
            if bool((totals[1] == 0).any()):
                raise MTNLGError(f"the reference pass left rows of the {name} split without a log-probability")
            tables[name] = (totals[0] / totals[1]).float().cpu().numpy()
        data.set_reference_tables(tables)

    def state_dict(self, module) -> dict:
        tables = module.trainer.datamodule.reference_tables() if precomputing(module) else {}
        return {REFERENCE_STATE: {name: torch.from_numpy(t) for name, t in tables.items()}} if tables else {}

    def load_state_dict(self, module, checkpoint: dict) -> None:
        """A resumed run reads the reference log-probabilities its first start computed: the restored weights are
        no longer the reference."""
        if not precomputing(module):
            return
        tables = checkpoint.get(REFERENCE_STATE)
        if not tables:
            raise MTNLGError(
                "this checkpoint holds no precomputed reference log-probabilities (it was saved without "
                "data.precompute_reference): resume it without that setting"
            )
        module.trainer.datamodule.set_reference_tables({name: t.numpy() for name, t in tables.items()})

    @staticmethod
    def scores(module) -> SequenceScores:
        """The layout's sequence log-probabilities (`SequenceScores`)."""
        return SequenceScores(module.loss_fn)

    def _reference_model(self, module):
        if module.frozen_base:
            return adapters_disabled(module.model)
        if precomputing(module):
            return nullcontext(module.model)  # before the first step: the policy is the reference
        if self.reference_weights is None:
            raise MTNLGError("full-weight DPO has no reference weights (they are taken when the layout is applied)")
        return self.reference_weights.swapped_into(module.model)

    def _reference_pass(self, module, batch: dict, rows_per_micro_batch: int) -> ReferenceLogps:
        collector = ReferenceLogps(self.scores(module), len(batch["labels"]), batch["labels"].device)
        training = module.model.training
        module.model.eval()  # the reference is deterministic: no dropout (TRL's reference model is in eval mode)
        try:
            with torch.no_grad(), self._reference_model(module):
                module.runner.evaluate(batch, rows_per_micro_batch, collector)
        finally:
            module.model.train(training)
        return collector

    def reference_logps(self, module, batch: dict, rows_per_micro_batch: int) -> torch.Tensor:
        """Each row's summed completion log-probability under the reference; `batch` carries row-indexed targets."""
        if batch.get(REFERENCE_LOGPS) is not None:
            return batch[REFERENCE_LOGPS].float()
        if precomputing(module):
            raise MTNLGError("a batch without its precomputed reference log-probabilities (data.precompute_reference)")
        return self._reference_pass(module, batch, rows_per_micro_batch).logps

    def _loss(self, module, batch: dict) -> tuple[dict, int, PreferenceLoss]:
        rows = 2 * module.micro_batch_size
        targeted = {**batch, "labels": with_row_index(batch["labels"])}
        reference = self.reference_logps(module, targeted, rows)
        rewards = PairRewards(len(batch["labels"]) // 2, batch["labels"].device)
        return targeted, rows, PreferenceLoss(self.config, self.scores(module), reference, rewards)

    def forward_backward(self, module, batch: dict) -> torch.Tensor:
        targeted, rows, loss_fn = self._loss(module, batch)
        loss = module.runner.forward_backward(targeted, rows, loss_fn)
        self.rewards = loss_fn.rewards
        return loss

    def evaluate(self, module, batch: dict) -> torch.Tensor:
        targeted, rows, loss_fn = self._loss(module, batch)
        loss = module.runner.evaluate(targeted, rows, loss_fn)
        self.rewards = loss_fn.rewards
        return loss

    def log_metrics(self, module, prefix: str = "") -> None:
        """The step's rewards, means over the global batch's pairs (one all-reduce of five sums)."""
        totals = module.trainer.strategy.reduce(self.rewards.totals, reduce_op="sum")
        pairs = int(self.rewards.seen.numel())
        for name, value in PairRewards.means(totals).items():
            module.log(f"{prefix}{name}", value, batch_size=pairs)
