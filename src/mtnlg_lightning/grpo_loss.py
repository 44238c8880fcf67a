"""The GRPO objective's arithmetic (Shao et al. 2024), as TRL 1.16's `GRPOTrainer` computes it: group-relative
advantages, per-token log-probs at the sampling temperature, the clipped surrogate with token- or sequence-level (GSPO)
importance ratios and the k3 KL penalty, and the four aggregations grpo, bnpo, dr_grpo and dapo.

Advantages. The G = num_generations completions of a prompt lie next to each other. A completion's reward is the
weighted sum of its reward functions' values (NaN, i.e. None, skipped); one for which every function returned None is
unscorable. Its advantage is (r - mean of its group) / (std + 1e-4), with NaN-aware means and Bessel's std over the
group ("group"), over the whole batch ("batch": the mean stays per group) or no division ("none"); an unscorable
completion, and every completion of a group with one scorable member, gets 0. The rewards are the whole generation
batch's (gathered over ranks), so a group is never split.

Losses. With r the ratio pi / pi_old (per token, or exp of the mean log-ratio over a sequence's completion tokens for
GSPO) and A a sequence's advantage, a completion token's loss is
    -min(r A, clamp(r, 1 - epsilon, 1 + epsilon_high) A)   [+ beta r k3,  k3 = exp(ref - logp) - (ref - logp) - 1]
(TRL's default use_bias_correction_kl multiplies k3 by r, which moves the gradient even where r == 1). Without old
log-probs (one update per generation batch) pi_old is the policy itself, detached: r == 1, and the gradient is the
policy gradient.

Aggregation, in any layout. `sequence_sums` reduces a micro-batch to each sequence's summed loss and completion
token count; `loss_of` turns those into the micro-batch's share of the loss of the whole global batch (every
micro-batch of every rank of one optimizer step), given that batch's sequence and token counts:
    grpo:          sum_b (s_b / max(n_b, 1)) / global_sequences           (the mean of the sequences' token means)
    bnpo, dapo:    sum_b s_b / max(global_tokens, 1)                       (the token mean over the global batch)
    dr_grpo:       sum_b s_b / (global_sequences x max_completion_length)
Each is linear in the sequences, so the shares of any split of the global batch, summed over micro-batches and ranks,
are the loss that one process computes on the whole batch in one micro-batch (which is TRL's value with one process
and no accumulation). A caller whose replicas average their gradients multiplies its share by the world size. bnpo
is dapo here: TRL's bnpo divides by a micro-batch's own token count, a value that depends on the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtnlg_lightning.config import reject_unknown_fields, typed_overrides
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.loss import IGNORE_INDEX

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
STD_EPSILON = 1e-4  # TRL's: added to the std before dividing


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO's settings, with TRL's names and defaults (`--model.grpo '{...}'`). top_k None (or TRL's 0) samples
    from the whole vocabulary; epsilon_high None is epsilon; scale_rewards True/False are TRL's group/none."""

    num_generations: int = 8
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    beta: float = 0.0
    mask_truncated_completions: bool = False
    # ours (TRL's log_completions): every N steps a table of a few prompts, completions and rewards (0: never)
    log_completions_every_n_steps: int = 0
    # ours: train a prompt's completions as branches of one row that computes the prompt once (where the layout
    # allows: not under a pipeline); false: a row per completion, as TRL (the same losses, more positions computed)
    share_prompts: bool = True

    def __post_init__(self):
        if _is_int(self.top_k) and self.top_k == 0:
            object.__setattr__(self, "top_k", None)
        if isinstance(self.scale_rewards, bool):
            object.__setattr__(self, "scale_rewards", "group" if self.scale_rewards else "none")
        problem = next(self._problems(), None)  # the first, in field order
        if problem is not None:
            raise MTNLGError(f"model.grpo {problem}")

    def _problems(self):
        if not _is_int(self.num_generations) or self.num_generations < 1:
            yield f"num_generations must be an integer >= 2, got {self.num_generations!r}"
        elif self.num_generations == 1:
            yield (
                "num_generations 1: a group of one has no variance, so every advantage (a reward minus its group's "
                "mean) would be 0 and nothing would be learned; set num_generations >= 2"
            )
        if not _is_int(self.max_completion_length) or self.max_completion_length < 1:
            yield f"max_completion_length must be an integer >= 1, got {self.max_completion_length!r}"
        if not _is_number(self.temperature) or not self.temperature > 0:
            yield f"temperature must be a number > 0, got {self.temperature!r}"
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            yield f"top_p must be a number in (0, 1], got {self.top_p!r}"
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            yield f"top_k must be an integer >= 1 (or null, or 0: the whole vocabulary), got {self.top_k!r}"
        if self.loss_type not in LOSS_TYPES:
            yield f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}"
        if self.scale_rewards not in SCALE_REWARDS:
            yield f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {self.scale_rewards!r}"
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            levels = ", ".join(IMPORTANCE_SAMPLING_LEVELS)
            yield f"importance_sampling_level must be one of {levels}, got {self.importance_sampling_level!r}"
        if not _is_number(self.epsilon) or not 0 < self.epsilon < 1:
            yield f"epsilon must be a number in (0, 1), got {self.epsilon!r}"
        if self.epsilon_high is not None and (not _is_number(self.epsilon_high) or not self.epsilon_high > 0):
            yield f"epsilon_high must be a number > 0 (or null: epsilon), got {self.epsilon_high!r}"
        if not _is_int(self.num_iterations) or self.num_iterations < 1:
            yield f"num_iterations must be an integer >= 1, got {self.num_iterations!r}"
        if not _is_number(self.beta) or self.beta < 0:
            yield f"beta must be a number >= 0, got {self.beta!r}"
        if not isinstance(self.mask_truncated_completions, bool):
            yield f"mask_truncated_completions must be true or false, got {self.mask_truncated_completions!r}"
        if not _is_int(self.log_completions_every_n_steps) or self.log_completions_every_n_steps < 0:
            every = self.log_completions_every_n_steps
            yield f"log_completions_every_n_steps must be an integer >= 0, got {every!r}"
        if not isinstance(self.share_prompts, bool):
            yield f"share_prompts must be true or false, got {self.share_prompts!r}"

    @property
    def clip_high(self) -> float:
        """The upper clipping epsilon: epsilon_high, or epsilon when it is not set."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def from_mapping(cls, values: dict | None) -> GRPOConfig:
        """The settings of `--model.grpo`: every key optional, an unknown key refused in one line."""
        if values is None:
            return cls()
        if not isinstance(values, dict):
            raise MTNLGError(f"model.grpo must be a mapping of GRPO settings, got {values!r}")
        reject_unknown_fields(values, cls, "model.grpo: unknown key(s)")
        return cls(**typed_overrides(values, cls))  # --model.grpo.temperature 0.8 arrives as "0.8"


# ------------------------------------------------------------------------------------------------ advantages
def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation with Bessel's correction over the values that are not NaN (NaN where fewer than 2)."""
    keep = dim is not None
    dims = dim if keep else tuple(range(values.dim()))
    mean = torch.nanmean(values, dim=dims, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dims, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dims, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze(dim) if keep else std.reshape(())


def group_advantages(
    rewards: torch.Tensor, weights: torch.Tensor, num_generations: int, scale_rewards: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each completion's advantage [N] from its reward functions' values `rewards` [N, F] (NaN where a function
    returned None; the G completions of a prompt contiguous) and the functions' weights [F], as TRL's
    sum_then_normalize; and the reward statistics TRL logs: `reward`, `reward_std`, `frac_reward_zero_std` (0-dim)
    and each function's NaN-skipping `function_mean`, `function_std` [F] (`reward_metrics` names them)."""
    if rewards.dim() != 2 or rewards.shape[0] % num_generations:
        raise ValueError(f"rewards {tuple(rewards.shape)} are not [groups x {num_generations}, functions]")
    unscorable = torch.isnan(rewards).all(dim=1)
    summed = (rewards * weights.to(rewards).unsqueeze(0)).nansum(dim=1).masked_fill(unscorable, float("nan"))
    grouped = summed.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(summed).expand_as(summed) if summed.numel() > 1 else torch.zeros_like(summed)
    elif num_generations > 1:  # group, and none (whose std only feeds frac_reward_zero_std)
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(summed)
    advantages = summed - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    stats = {
        "reward": torch.nanmean(summed),
        "reward_std": nanstd(summed),
        "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean(),
        "function_mean": torch.nanmean(rewards, dim=0),
        "function_std": nanstd(rewards, dim=0),
    }
    return torch.nan_to_num(advantages, nan=0.0), stats


def reward_metrics(stats: dict[str, torch.Tensor], names: list[str]) -> dict[str, float]:
    """`group_advantages`' statistics under TRL's metric names, the reward functions called `names`."""
    out = {key: stats[key].item() for key in ("reward", "reward_std", "frac_reward_zero_std")}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = stats["function_mean"][i].item()
        out[f"rewards/{name}/std"] = stats["function_std"][i].item()
    return out


# ------------------------------------------------------------------------------------------------ log-probs
def completion_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(label) [B, S] under softmax(logits / temperature) of logits [B, S, V], in fp32; 0 where the label is
    IGNORE_INDEX (every position that is not a completion token)."""
    scaled = logits.float() / temperature
    flat = F.cross_entropy(scaled.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return -flat.view_as(labels)


@torch.no_grad()
def completion_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """The entropy [B, S] of softmax(logits / temperature) where the label is a completion token, 0 elsewhere (for
    the `entropy` metric: no gradient)."""
    counted = labels.ne(IGNORE_INDEX)
    logp = torch.log_softmax(logits[counted].float() / temperature, dim=-1)
    out = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    out[counted] = -(logp.exp() * logp).sum(-1)
    return out


# ------------------------------------------------------------------------------------------------ losses
def per_token_losses(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each completion token's loss [B, T] (0 where `mask`, 0/1 or bool, is not set) from the policy's log-probs
    `logp` [B, T], the sampling policy's `old_logp` (None: the policy itself, detached), the reference's `ref_logp`
    (read when beta != 0) and each sequence's advantage [B] (or per token, [B, T]); and the parts the metrics need,
    detached: `ratio` and the TRL clip indicators `clipped_low` (r < 1 - epsilon where A < 0), `clipped_high`
    (r > 1 + epsilon_high where A > 0) and `clipped_region` (either), [B, T] per token or [B, 1] per sequence, and
    `kl` [B, T] (beta != 0 only)."""
    m = mask.bool()
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old_logp = logp.detach() if old_logp is None else old_logp
    log_ratio = (logp - old_logp).masked_fill(~m, 0.0)
    if config.importance_sampling_level == "sequence":
        log_ratio = (log_ratio.sum(-1) / m.sum(-1).clamp(min=1)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + config.clip_high)
    losses = -torch.min(ratio * advantages, clipped * advantages)
    parts = {"ratio": ratio.detach()}
    parts["clipped_low"] = (parts["ratio"] < 1 - config.epsilon) & (advantages < 0)
    parts["clipped_high"] = (parts["ratio"] > 1 + config.clip_high) & (advantages > 0)
    parts["clipped_region"] = parts["clipped_low"] | parts["clipped_high"]
    if config.beta != 0:
        delta = (ref_logp - logp).masked_fill(~m, 0.0)
        kl = (torch.exp(delta) - delta - 1) * ratio  # TRL's use_bias_correction_kl
        losses = losses + config.beta * kl
        parts["kl"] = kl.detach()
    return losses.expand_as(logp).masked_fill(~m, 0.0), parts


def sequence_sums(losses: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's loss summed over its completion tokens [B] and how many it has [B] (float)."""
    m = mask.bool()
    return losses.masked_fill(~m, 0.0).sum(-1), m.sum(-1).to(losses.dtype)


def loss_of(
    sums: torch.Tensor,
    tokens: torch.Tensor,
    config: GRPOConfig,
    global_sequences: int | torch.Tensor,
    global_tokens: int | torch.Tensor,
) -> torch.Tensor:
    """These sequences' share of the loss of the global batch that holds `global_sequences` sequences and
    `global_tokens` completion tokens (after truncation masking), from their `sequence_sums`: the shares of all
    the global batch's micro-batches, on every rank, sum to its loss as one process computes it in one go."""
    if config.loss_type == "grpo":
        return (sums / tokens.clamp(min=1)).sum() / global_sequences
    if config.loss_type == "dr_grpo":
        return sums.sum() / (global_sequences * config.max_completion_length)
    # bnpo, dapo
    return sums.sum() / torch.as_tensor(global_tokens, dtype=sums.dtype, device=sums.device).clamp(min=1)


# ------------------------------------------------------------------------------------------------ metrics
def metric_sums(
    parts: dict[str, torch.Tensor], mask: torch.Tensor, entropy: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """TRL's metrics that are means over the global batch, each as [sum, count] (fp64) to sum over micro-batches
    and ranks: `kl` and `entropy` over completion tokens, `clip_ratio/{low,high,region}_mean` over completion
    tokens (per token) or over sequences (sequence-level ratios). `metric_means` divides."""
    m = mask.bool()

    def masked(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == 1:  # one value per sequence: every sequence counts, as in TRL
            return torch.stack([x.double().sum(), x.new_tensor(x.shape[0], dtype=torch.float64)])
        return torch.stack([x.double().masked_fill(~m, 0.0).sum(), m.sum().double()])

    out = {}
    if "kl" in parts:
        out["kl"] = masked(parts["kl"])
    if entropy is not None:
        out["entropy"] = masked(entropy)
    for which in ("low", "high", "region"):
        out[f"clip_ratio/{which}_mean"] = masked(parts[f"clipped_{which}"])
    return out


def metric_means(totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The means of `metric_sums`' totals (summed over micro-batches and ranks); 0 where nothing counted."""
    return {name: (total[0] / total[1].clamp(min=1)).float() for name, total in totals.items()}


def sequence_clip_fractions(parts: dict[str, torch.Tensor], mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's share of low- and high-clipped tokens [B] (NaN for a sequence without completion tokens, per
    token); TRL logs the NaN-skipping min of the first as `clip_ratio/low_min`, the max of the second as
    `clip_ratio/high_max`, over the gathered batch."""
    m = mask.to(torch.float32)

    def per_sequence(x: torch.Tensor) -> torch.Tensor:
        return x.float().squeeze(1) if x.shape[-1] == 1 else (x.float() * m).sum(-1) / m.sum(-1)

    return per_sequence(parts["clipped_low"]), per_sequence(parts["clipped_high"])


# ------------------------------------------------------------------------------------------------ truncation
def mask_truncated(
    mask: torch.Tensor, completion_ids: torch.Tensor, eos_ids: list[int] | tuple[int, ...], pad_id: int | None
) -> torch.Tensor:
    """`mask` [B, T] with every completion that was cut off zeroed: one whose last id (at the last set position of
    its mask) is neither an end-of-sequence id nor the pad id (TRL's mask_truncated_completions). A row without
    completion tokens is left as it is."""
    m = mask.bool()
    positions = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    last = torch.where(m, positions, -1).amax(-1)
    last_ids = completion_ids.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)
    ends = torch.tensor([*eos_ids, *([] if pad_id is None else [pad_id])], device=completion_ids.device)
    truncated = (last >= 0) & ~torch.isin(last_ids, ends)
    return mask * (~truncated).unsqueeze(1).to(mask.dtype)
