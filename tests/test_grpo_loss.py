"""GRPO's loss core (`grpo_loss`): on the same Llama weights and batch, the loss, every parameter's gradient and the
kl, entropy and clip metrics equal TRL 1.16's `GRPOTrainer._compute_loss` for each loss type, importance-sampling
level, KL weight and old log-probs; the advantages, reward statistics and truncation mask equal what TRL's
`_generate_and_score_completions` makes of the same rewards; the shares of any micro-batch split sum to the
whole-batch loss; and every bad setting is one line. With LoRA, and one optimizer step: test_grpo_trl_parity.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from grpo_trl import (
    CASES,
    GENERATIONS,
    REWARDS,
    hand_built_batch,
    llama_directory,
    our_loss,
    our_model,
    trl_case_inputs,
    trl_loss,
    trl_trainer,
)

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.grpo_loss import (
    LOSS_TYPES,
    GRPOConfig,
    completion_entropy,
    group_advantages,
    loss_of,
    mask_truncated,
    metric_means,
    metric_sums,
    per_token_losses,
    reward_metrics,
    sequence_clip_fractions,
    sequence_sums,
)


# ------------------------------------------------------------------------------------------------ the settings
def test_the_defaults_are_trls():
    config = GRPOConfig.from_mapping(None)
    assert config == GRPOConfig()
    assert (config.num_generations, config.max_completion_length, config.loss_type) == (8, 512, "dapo")
    assert (config.scale_rewards, config.importance_sampling_level, config.beta) == ("group", "token", 0.0)
    assert (config.epsilon, config.clip_high, config.top_k) == (0.2, 0.2, None)
    custom = GRPOConfig.from_mapping({"epsilon_high": 0.28, "scale_rewards": False, "top_k": 0, "loss_type": "grpo"})
    assert (custom.clip_high, custom.scale_rewards, custom.top_k, custom.loss_type) == (0.28, "none", None, "grpo")


@pytest.mark.parametrize(
    "values, says",
    [
        ({"num_generations": 0}, r"model.grpo num_generations must be an integer >= 2, got 0"),
        ({"num_generations": 2.5}, r"model.grpo num_generations must be an integer >= 2, got 2.5"),
        ({"num_generations": 1}, r"model.grpo num_generations 1: a group of one has no variance.*>= 2"),
        ({"num_generations": 1, "scale_rewards": "none"}, r"model.grpo num_generations 1: "),
        ({"max_completion_length": 0}, r"model.grpo max_completion_length must be an integer >= 1"),
        ({"temperature": 0}, r"model.grpo temperature must be a number > 0, got 0"),
        ({"top_p": 1.5}, r"model.grpo top_p must be a number in \(0, 1\]"),
        ({"top_k": -3}, r"model.grpo top_k must be an integer >= 1"),
        ({"loss_type": "ppo"}, r"model.grpo loss_type must be one of grpo, bnpo, dr_grpo, dapo, got 'ppo'"),
        ({"scale_rewards": "prompt"}, r"model.grpo scale_rewards must be one of group, batch, none"),
        ({"importance_sampling_level": "tok"}, r"model.grpo importance_sampling_level must be one of token, sequence"),
        ({"epsilon": 1.0}, r"model.grpo epsilon must be a number in \(0, 1\), got 1.0"),
        ({"epsilon_high": -0.1}, r"model.grpo epsilon_high must be a number > 0"),
        ({"num_iterations": 0}, r"model.grpo num_iterations must be an integer >= 1"),
        ({"beta": -0.04}, r"model.grpo beta must be a number >= 0, got -0.04"),
        ({"beta": float("nan")}, r"model.grpo beta must be a number >= 0"),
        ({"mask_truncated_completions": "maybe"}, r"model.grpo mask_truncated_completions must be true or false"),
        ({"epsilon_low": 0.1}, r"model.grpo: unknown key\(s\) \['epsilon_low'\]; valid fields: "),
        ("dapo", r"model.grpo must be a mapping of GRPO settings, got 'dapo'"),
    ],
)
def test_a_bad_setting_is_one_line_naming_model_grpo_and_the_key(values, says):
    with pytest.raises(MTNLGError, match=says) as caught:
        GRPOConfig.from_mapping(values)
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------------------------------------ aggregation
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_shares_of_any_micro_batch_split_sum_to_the_whole_batch_loss(loss_type):
    """Split 7 sequences (one without completion tokens) in 1, 2 and 3 micro-batches of uneven sizes: the shares,
    each computed with the global batch's counts, sum to the whole-batch loss, which is the loss type's formula."""
    config = GRPOConfig(loss_type=loss_type, max_completion_length=12)
    generator = torch.Generator().manual_seed(0)
    losses = torch.randn(7, 10, generator=generator)
    mask = torch.rand(7, 10, generator=generator) < 0.6
    mask[4] = False
    sequences, tokens = len(mask), int(mask.sum())
    sums, counts = sequence_sums(losses, mask)
    whole = loss_of(sums, counts, config, sequences, tokens)
    token_means = (losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    expected = {
        "grpo": token_means.mean(),
        "bnpo": (losses * mask).sum() / tokens,
        "dapo": (losses * mask).sum() / tokens,
        "dr_grpo": (losses * mask).sum() / (sequences * 12),
    }[loss_type]
    torch.testing.assert_close(whole, expected, rtol=1e-6, atol=0)
    for cuts in ([3], [1, 5]):
        shares = []
        for rows in torch.tensor_split(torch.arange(sequences), cuts):
            part_sums, part_counts = sequence_sums(losses[rows], mask[rows])
            shares.append(loss_of(part_sums, part_counts, config, sequences, tokens))
        torch.testing.assert_close(sum(shares), whole, rtol=1e-6, atol=1e-7)


def test_losses_are_zero_off_the_mask_even_where_old_log_probs_are_far_off():
    """Positions that are no completion token hold 0, however far the old log-probs there are (no inf * 0)."""
    logp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -200.0]])
    mask = torch.tensor([[True, True, False]])
    for level in ("token", "sequence"):
        config = GRPOConfig(importance_sampling_level=level, beta=0.04)
        losses, _ = per_token_losses(logp, old, old, torch.tensor([1.0]), mask, config)
        assert losses[0, 2] == 0 and torch.isfinite(losses).all()
        (grad,) = torch.autograd.grad(losses.sum(), logp)
        assert torch.isfinite(grad).all() and grad[0, 2] == 0


# ------------------------------------------------------------------------------------------------ against TRL
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return llama_directory(tmp_path_factory)


@pytest.fixture(scope="module")
def trainer(llama_dir, tmp_path_factory):
    """TRL's GRPOTrainer on the Llama directory, built once; each test sets the attributes `_compute_loss` reads."""
    pytest.importorskip("trl")
    return trl_trainer(llama_dir, tmp_path_factory.mktemp("trl"))


@pytest.fixture(scope="module")
def ours(llama_dir):
    return our_model(llama_dir)


@pytest.fixture(scope="module")
def batch(ours, trainer):
    return hand_built_batch(ours, trainer.processing_class.pad_token_id)


@pytest.mark.parametrize("loss_type, level, beta, old", CASES)
def test_loss_gradients_and_metrics_equal_trls(loss_type, level, beta, old, trainer, ours, batch):
    """`_compute_loss` of TRL's GRPOTrainer (one process, no accumulation) and ours, from our model's logits on the
    same weights and batch: the same loss (1e-5), every parameter's gradient (within 1e-5 of the tensor's largest)
    and the kl, entropy and clip-ratio metrics."""
    from mtnlg_lightning import families

    case = (loss_type, level, beta, old)
    trl_inputs, ids, labels, old_logp, ref_logp = batch
    trl_value, theirs = trl_loss(trainer, trl_case_inputs(trainer, trl_inputs, old_logp, ref_logp, case))
    loss, config, logits, parts, mask = our_loss(ours, ids, labels, old_logp, ref_logp, case)

    torch.testing.assert_close(loss, trl_value, rtol=1e-5, atol=1e-7)
    compared = 0
    for name, sources in families.hf_tensors(families.family_of(ours.config), ours.config).items():
        expected = trainer.model.get_parameter(sources[0]).grad
        torch.testing.assert_close(ours.get_parameter(name).grad, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())
        compared += 1
    assert compared == len(list(ours.parameters()))

    means = metric_means(metric_sums(parts, mask, completion_entropy(logits, labels, config.temperature)))
    assert ("kl" in means) == bool(beta) and set(means) <= set(theirs)
    for name, value in means.items():
        assert value.item() == pytest.approx(theirs[name], rel=1e-5, abs=1e-6), name
    low, high = sequence_clip_fractions(parts, mask)
    assert low.nan_to_num(math.inf).min().item() == pytest.approx(theirs["clip_ratio/low_min"])
    assert high.nan_to_num(-math.inf).max().item() == pytest.approx(theirs["clip_ratio/high_max"])
    if old == "perturbed":  # the clipped branch is exercised: ratios below 1 - epsilon at A < 0 and above at A > 0
        assert parts["clipped_low"].any() and parts["clipped_high"].any()


def scored(trainer, completion_ids: list[list[int]]) -> dict:
    """TRL's `_generate_and_score_completions` on 2 prompts x 3 completions, generation stubbed to return
    `completion_ids`; the reward functions return REWARDS."""
    rows = len(completion_ids)

    def generate(prompts):
        texts = ["x"] * rows
        return [[5, 6, 7]] * rows, completion_ids, None, texts, None, None, None, None

    trainer._generate = generate
    try:
        return trainer._generate_and_score_completions([{"prompt": f"p{i // GENERATIONS}"} for i in range(rows)])
    finally:
        del trainer._generate


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_and_reward_statistics_equal_trls(scale_rewards, trainer):
    """A group whose weighted rewards are all equal (std 0: advantages 0) and a group with an unscorable completion
    (every function None: advantage 0, left out of its group's mean and std): TRL's advantages and logged reward
    statistics, and, for the group scaling, the numbers worked by hand."""
    trainer.scale_rewards, trainer.beta = scale_rewards, 0.0
    trainer._metrics["train"].clear()
    output = scored(trainer, [[9, 10]] * len(REWARDS))
    theirs = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    rewards = torch.tensor(REWARDS)
    advantages, stats = group_advantages(rewards, torch.tensor([1.0, 0.5]), GENERATIONS, scale_rewards)
    torch.testing.assert_close(advantages, output["advantages"], rtol=0, atol=0)
    for name, value in reward_metrics(stats, ["reward_a", "reward_b"]).items():
        assert value == pytest.approx(theirs[name], rel=1e-6, nan_ok=True), name
    if scale_rewards == "group":
        std = math.sqrt(2 * 0.75**2)  # group 1 scores 0.5 and 2.0: mean 1.25, Bessel's std over 2
        expected = [0.0, 0.0, 0.0, -0.75 / (std + 1e-4), 0.75 / (std + 1e-4), 0.0]
        torch.testing.assert_close(advantages, torch.tensor(expected), rtol=1e-6, atol=1e-7)
        assert stats["frac_reward_zero_std"].item() == 0.5


def test_truncated_completions_are_masked_as_trls(trainer):
    """mask_truncated_completions: a completion whose last id is neither end-of-text nor pad loses its whole mask;
    TRL's completion mask and token count equal ours."""
    eos = trainer.processing_class.eos_token_id
    completion_ids = [[9, 10, eos], [9, 10, 11, 12], [9], [9, eos], [9, 10, 11], [9, 10, 11, 12, eos]]
    trainer.mask_truncated_completions = True
    try:
        output = scored(trainer, completion_ids)
    finally:
        trainer.mask_truncated_completions = False
    padded = torch.full((len(completion_ids), 5), eos)
    mask = torch.zeros(padded.shape, dtype=torch.long)
    for row, ids in enumerate(completion_ids):
        padded[row, : len(ids)], mask[row, : len(ids)] = torch.tensor(ids), 1
    masked = mask_truncated(mask, padded, trainer.eos_token_ids, trainer.processing_class.pad_token_id)
    assert masked[:, 0].tolist() == [1, 0, 0, 1, 0, 1]
    torch.testing.assert_close(masked, output["completion_mask"], rtol=0, atol=0)
    assert int(masked.sum()) == int(output["num_items_in_batch"])
