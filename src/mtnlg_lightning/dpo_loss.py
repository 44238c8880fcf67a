"""The preference objective: DPO (Rafailov et al. 2023) and IPO (Azar et al. 2023) on chosen/rejected pairs.

A pair's chosen and rejected sequences lie next to each other in a batch (rows 2i and 2i + 1: `data.preferences`),
so every split of a batch into micro-batches of an even number of rows keeps each pair whole, on one rank.

Each sequence's log-probability is summed over its completion tokens (its labels that are not IGNORE_INDEX); the
policy's and the reference's use the same labels, hence the same mask. With the log-ratios
    c = log pi(chosen) - log ref(chosen),  r = log pi(rejected) - log ref(rejected),
a pair's loss is
    sigmoid (DPO):  -(1 - e) log sigmoid(beta (c - r)) - e log sigmoid(-beta (c - r))   (e: label smoothing, cDPO)
    ipo:            (c / n_c - r / n_r - 1 / (2 beta))^2                                   (n: completion tokens)
IPO's log-ratios are averaged over the completion tokens, as TRL defines it. The logged rewards are TRL's:
beta c, beta r, their margin and the share of pairs whose margin is positive. At policy == reference the DPO loss is
ln 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.loss import IGNORE_INDEX

DPO_LOSSES = ("sigmoid", "ipo")
# The logged reward statistics, in the order `PairRewards.totals` holds them (then the pair count).
REWARD_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


@dataclass(frozen=True)
class DPOConfig:
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self):
        if not isinstance(self.beta, int | float) or isinstance(self.beta, bool) or not self.beta > 0:
            raise MTNLGError(f"model.dpo_beta must be a number > 0, got {self.beta!r}")
        if self.loss not in DPO_LOSSES:
            raise MTNLGError(f"model.dpo_loss must be one of {', '.join(DPO_LOSSES)}, got {self.loss!r}")
        if not 0 <= self.label_smoothing < 0.5:
            raise MTNLGError(f"model.dpo_label_smoothing must be in [0, 0.5), got {self.label_smoothing!r}")
        if self.label_smoothing and self.loss != "sigmoid":
            raise MTNLGError("model.dpo_label_smoothing applies to dpo_loss sigmoid only")


def per_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log p(label) of logits [B, S, V] in fp32, [B, S]; 0 where the label is IGNORE_INDEX."""
    flat = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return flat.view_as(labels)


def sequence_logps(per_token_nll: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-probability summed over its counted labels, [B], and how many it has, [B] (float)."""
    counted = labels.ne(IGNORE_INDEX)
    # masked_fill, not a product: the vocabulary-parallel loss leaves any value at ignored positions
    return -per_token_nll.masked_fill(~counted, 0.0).sum(-1), counted.sum(-1).to(per_token_nll.dtype)


def pair_losses(
    config: DPOConfig,
    policy: torch.Tensor,
    reference: torch.Tensor,
    tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses [P] and the rewards of the chosen and rejected sequences [P] (detached), from the summed
    log-probs of the policy and the reference and the completion token counts, each [2P] with pairs interleaved
    (chosen, rejected, chosen, ...)."""
    ratios = (policy - reference.to(policy.dtype)).view(-1, 2)
    chosen, rejected = ratios[:, 0], ratios[:, 1]
    if config.loss == "ipo":
        counts = tokens.view(-1, 2).clamp(min=1)
        delta = chosen / counts[:, 0] - rejected / counts[:, 1]
        losses = (delta - 1 / (2 * config.beta)) ** 2
    else:
        logits = config.beta * (chosen - rejected)
        smoothing = config.label_smoothing
        losses = -F.logsigmoid(logits) * (1 - smoothing)
        if smoothing:
            losses = losses - F.logsigmoid(-logits) * smoothing
    return losses, config.beta * chosen.detach(), config.beta * rejected.detach()


class PairRewards:
    """The rewards of a step's pairs on this rank, each pair's written at its index in the rank's batch: a loss
    function called again for a micro-batch (a pipeline schedule's metadata pass, on placeholder outputs, comes
    before the real one) overwrites, never adds."""

    def __init__(self, pairs: int, device):
        self.chosen = torch.zeros(pairs, dtype=torch.float64, device=device)
        self.rejected = torch.zeros(pairs, dtype=torch.float64, device=device)
        self.seen = torch.zeros(pairs, dtype=torch.bool, device=device)

    def record(self, pairs: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        self.chosen[pairs], self.rejected[pairs], self.seen[pairs] = chosen.double(), rejected.double(), True

    @property
    def totals(self) -> torch.Tensor:
        """[chosen, rejected, margin, correct (margin > 0), pairs] summed over the pairs seen on this rank (none on a
        pipeline stage that computes no loss)."""
        chosen, rejected = self.chosen[self.seen], self.rejected[self.seen]
        margin = chosen - rejected
        parts = (chosen.sum(), rejected.sum(), margin.sum(), (margin > 0).sum(), self.seen.sum())
        return torch.stack([part.double() for part in parts])

    @staticmethod
    def means(totals: torch.Tensor) -> dict[str, torch.Tensor]:
        """The logged values from totals summed over ranks (ranks that hold the same pairs count them in both the
        sums and the pair count alike, so the means are those over the global batch's pairs)."""
        pairs = totals[-1].clamp(min=1)
        return {name: (totals[i] / pairs).float() for i, name in enumerate(REWARD_NAMES)}
