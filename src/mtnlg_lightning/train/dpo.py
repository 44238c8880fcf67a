"""A preference-tuning step (`--model.objective dpo`): the reference pass, then the policy's forward and backward
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
- or log-probs the data brings (`reference_logps` in the batch), used as they are.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from mtnlg_lightning.dpo_loss import DPOConfig, PairRewards, pair_losses, per_token_cross_entropy, sequence_logps
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.parallel.lora import adapters_disabled

REFERENCE_LOGPS = "reference_logps"  # a batch field [rows] when the data brings the reference log-probs


def with_row_index(labels: torch.Tensor) -> torch.Tensor:
    """[R, S] labels -> [R, S + 1] targets: each row's labels, then its index in the batch."""
    rows = torch.arange(len(labels), device=labels.device, dtype=labels.dtype)
    return torch.cat([labels, rows[:, None]], dim=1)


def split_target(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return target[:, :-1], target[:, -1]


class ReferenceLogps:
    """A forward-only 'loss' that records each row's summed completion log-probability (on the ranks that compute
    the loss: every rank, or the last pipeline stage) and contributes nothing."""

    def __init__(self, per_token_nll, rows: int, device):
        self.per_token_nll = per_token_nll
        self.logps = torch.zeros(rows, dtype=torch.float32, device=device)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, rows = split_target(target)
        logps, _ = sequence_logps(self.per_token_nll(logits, labels), labels)
        self.logps[rows] = logps.detach().float()
        return logps.new_zeros(())


class PreferenceLoss:
    """A micro-batch's DPO/IPO loss: the mean over its pairs (every micro-batch holds as many pairs, so the step's
    mean over micro-batches and data-parallel replicas is the mean over the global batch's pairs)."""

    def __init__(self, config: DPOConfig, per_token_nll, reference: torch.Tensor, rewards: PairRewards):
        self.config, self.per_token_nll, self.reference, self.rewards = config, per_token_nll, reference, rewards

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, rows = split_target(target)
        policy, tokens = sequence_logps(self.per_token_nll(logits, labels), labels)
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


class PreferenceStep:
    """The module's DPO step: `forward_backward` and `evaluate` as the runner's, on pairs; `log_rewards` after."""

    def __init__(self, config: DPOConfig):
        self.config = config
        self.reference_weights: ReferenceWeights | None = None
        self.rewards: PairRewards | None = None

    def take_reference(self, module) -> None:
        """Full-weight DPO: the reference is the model as its layout holds it before a checkpoint is restored into
        it or any update (the starting weights, on a resume too)."""
        if module.lora is None and self.reference_weights is None:
            self.reference_weights = ReferenceWeights(module.model)

    def check_layout(self, module, strategy) -> None:
        config = getattr(strategy, "parallel_config", None)
        if config is not None and config.context_parallel > 1:
            raise MTNLGError("model.objective dpo does not run under context parallelism yet (context_parallel 1)")
        if module.lora is None and getattr(strategy, "zero_stage", 0) >= 3:
            raise MTNLGError("full-weight DPO under ZeRO-3 is not supported yet: use zero_stage 1 or 2, or LoRA")

    @staticmethod
    def per_token_nll(module):
        """The layout's per-token loss: vocabulary-parallel under TP, else plain cross-entropy."""
        return getattr(module.loss_fn, "per_token", per_token_cross_entropy)

    def _reference_model(self, module):
        if module.lora is not None:
            return adapters_disabled(module.model)
        if self.reference_weights is None:
            raise MTNLGError("full-weight DPO has no reference weights (they are taken when the layout is applied)")
        return self.reference_weights.swapped_into(module.model)

    def reference_logps(self, module, batch: dict, rows_per_micro_batch: int) -> torch.Tensor:
        """Each row's summed completion log-probability under the reference; `batch` carries row-indexed targets."""
        if batch.get(REFERENCE_LOGPS) is not None:
            return batch[REFERENCE_LOGPS].float()
        collector = ReferenceLogps(self.per_token_nll(module), len(batch["labels"]), batch["labels"].device)
        training = module.model.training
        module.model.eval()  # the reference is deterministic: no dropout (TRL's reference model is in eval mode)
        try:
            with torch.no_grad(), self._reference_model(module):
                module.runner.evaluate(batch, rows_per_micro_batch, collector)
        finally:
            module.model.train(training)
        return collector.logps

    def _loss(self, module, batch: dict) -> tuple[dict, int, PreferenceLoss]:
        rows = 2 * module.micro_batch_size
        targeted = {**batch, "labels": with_row_index(batch["labels"])}
        reference = self.reference_logps(module, targeted, rows)
        rewards = PairRewards(len(batch["labels"]) // 2, batch["labels"].device)
        return targeted, rows, PreferenceLoss(self.config, self.per_token_nll(module), reference, rewards)

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

    def log_rewards(self, module, prefix: str = "") -> None:
        """The step's rewards, means over the global batch's pairs (one all-reduce of five sums)."""
        totals = module.trainer.strategy.reduce(self.rewards.totals, reduce_op="sum")
        pairs = int(self.rewards.seen.numel())
        for name, value in PairRewards.means(totals).items():
            module.log(f"{prefix}{name}", value, batch_size=pairs)
