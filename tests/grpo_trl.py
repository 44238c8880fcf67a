"""What the GRPO parity tests against TRL 1.16 share (test_grpo_loss.py, test_grpo_trl_parity.py): the settings, a
hand-built batch of 2 prompts x 3 completions of ragged lengths, TRL's GRPOTrainer on a tiny random Llama
directory, our model on the same weights, and one loss computed each way."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch

from mtnlg_lightning.grpo_loss import LOSS_TYPES, GRPOConfig, completion_logps, loss_of, per_token_losses, sequence_sums
from mtnlg_lightning.interop.init_from import config_for_init, load_init_weights
from mtnlg_lightning.loss import IGNORE_INDEX
from mtnlg_lightning.model import build_model
from mtnlg_lightning.parallel.lora import LoRAConfig, apply_lora

GENERATIONS, PROMPT, COMPLETION = 3, 5, 7
# The settings TRL's trainer and our config share (TRL's names); each case sets loss type, ratio level and beta.
SHARED = dict(num_generations=GENERATIONS, max_completion_length=16, temperature=0.7, epsilon=0.2, epsilon_high=0.28)
LENGTHS = (7, 4, 6, 2, 7, 5)  # each completion's length: right padding up to COMPLETION
ADVANTAGES = (1.2, -0.7, 0.3, -1.5, 0.9, -0.4)
# The rewards of 2 prompts x 3 completions from two functions weighted 1 and 0.5 (NaN: the function returned None).
# Group 0's weighted sums are equal (std 0); in group 1 the last completion is unscorable (every function None).
NAN = float("nan")
REWARDS = ((1.0, 0.5), (1.5, -0.5), (1.25, 0.0), (0.0, 1.0), (2.0, NAN), (NAN, NAN))
# loss type x importance-sampling level x beta x old log-probs ("perturbed": num_iterations > 1's stored ones)
CASES = list(itertools.product(LOSS_TYPES, ("token", "sequence"), (0.0, 0.04), ("on-policy", "perturbed")))


def reward_a(prompts, completions, completion_ids, **kwargs):
    return [None if math.isnan(a) else a for a, _ in REWARDS]


def reward_b(prompts, completions, completion_ids, **kwargs):
    return [None if math.isnan(b) else b for _, b in REWARDS]


def llama_directory(tmp_path_factory) -> Path:
    from hf_models import random_family_dir

    return random_family_dir(tmp_path_factory.mktemp("grpo"), "llama")


def trl_trainer(llama_dir: Path, output_dir: Path, peft_config=None, **settings):
    """TRL's GRPOTrainer on the Llama directory (wrapped by peft with `peft_config`), fp32 on the CPU, in training
    mode; `settings`: more of trl.GRPOConfig's fields. Each test sets the attributes `_compute_loss` reads."""
    import transformers
    import trl
    from datasets import Dataset

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(llama_dir / "tokenizer.json"), eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    args = trl.GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,  # TRL's default autocasts to bf16 on CPUs that have it
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=2 * GENERATIONS,
        reward_weights=[1.0, 0.5],
        **SHARED,
        **settings,
    )
    dataset = Dataset.from_list([{"prompt": "a b"}, {"prompt": "c d"}])
    trainer = trl.GRPOTrainer(
        model=str(llama_dir),
        reward_funcs=[reward_a, reward_b],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop only
    trainer.model.train()
    return trainer


def our_model(llama_dir: Path, lora: LoRAConfig | None = None) -> torch.nn.Module:
    """Our model on the directory's weights, with `lora`'s adapters (B zero until a test sets it), in training mode."""
    model = build_model(config_for_init(str(llama_dir), "tiny", None))
    load_init_weights(model, str(llama_dir))
    if lora is not None:
        apply_lora(model, lora)
    return model.train()


def hand_built_batch(model: torch.nn.Module, pad: int):
    """TRL's layout (prompts of one length, as our model reads no padding mask; completions right-padded, a
    completion mask) and ours (prompt and completion in one row, the completion tokens as the labels of the
    positions before them); old and reference log-probs perturbed from `model`'s so that ratios fall on both sides
    of the clip range. Returns (TRL's inputs, our ids, our labels, old [B, C], reference [B, C])."""
    generator = torch.Generator().manual_seed(0)
    rows = len(LENGTHS)
    prompt_ids = torch.randint(5, 4096, (rows // GENERATIONS, PROMPT), generator=generator)
    prompt_ids = prompt_ids.repeat_interleave(GENERATIONS, dim=0)
    completion_mask = (torch.arange(COMPLETION) < torch.tensor(LENGTHS).unsqueeze(1)).long()
    completion_ids = torch.randint(5, 4096, (rows, COMPLETION), generator=generator)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, PROMPT - 1 : -1] = completion_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)
    logp = policy_logps(model, ids, labels)
    # log pi_old - log pi per sequence: the ratio crosses 1 + epsilon_high where A > 0 (rows 0 and 4), 1 - epsilon
    # where A < 0 (rows 1 and 3) and stays inside for rows 2 and 5, per sequence (and mostly per token)
    per_sequence = torch.tensor([-0.4, 0.4, 0.1, 0.35, -0.35, -0.05]).unsqueeze(1)
    old = (logp + per_sequence + 0.2 * torch.randn(rows, COMPLETION, generator=generator)) * completion_mask
    ref = (logp + 0.1 * torch.randn(rows, COMPLETION, generator=generator)) * completion_mask
    trl_inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(ADVANTAGES),
        "num_items_in_batch": completion_mask.sum(),
    }
    return trl_inputs, ids, labels, old, ref


@torch.no_grad()
def policy_logps(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`model`'s log-probs of the completion tokens at the shared temperature, [B, C] (0 on padding)."""
    return completion_logps(model(ids), labels, SHARED["temperature"])[:, PROMPT - 1 : -1]


def in_our_layout(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Values at TRL's completion positions [B, C] placed at the positions whose labels are those tokens [B, S]."""
    out = torch.zeros(labels.shape)
    out[:, PROMPT - 1 : -1] = values
    return out


def trl_case_inputs(trainer, trl_inputs: dict, old: torch.Tensor | None, ref: torch.Tensor, case) -> dict:
    """Set the trainer's loss type, level and beta to `case`'s; TRL's inputs with the reference log-probs, and the
    old ones where `case` is "perturbed" (else TRL takes the policy's own, detached)."""
    loss_type, level, beta, kind = case
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, level, beta
    inputs = dict(trl_inputs, ref_per_token_logps=ref)
    if kind == "perturbed":
        inputs["old_per_token_logps"] = old
    return inputs


def trl_loss(trainer, inputs: dict) -> tuple[torch.Tensor, dict]:
    """TRL's `_compute_loss` (one process, no accumulation) on fresh gradients, backward run; and its metrics."""
    trainer._metrics["train"].clear()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}


def our_loss(model, ids, labels, old: torch.Tensor | None, ref: torch.Tensor, case):
    """Our loss of `case` on fresh gradients, backward run: (loss, config, logits, per-token parts, mask)."""
    loss_type, level, beta, kind = case
    config = GRPOConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta, **SHARED)
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    mask = labels.ne(IGNORE_INDEX)
    old = in_our_layout(old, labels) if kind == "perturbed" else None
    logp = completion_logps(logits, labels, config.temperature)
    advantages = torch.tensor(ADVANTAGES)
    losses, parts = per_token_losses(logp, old, in_our_layout(ref, labels), advantages, mask, config)
    sums, tokens = sequence_sums(losses, mask)
    loss = loss_of(sums, tokens, config, len(ids), int(mask.sum()))
    loss.backward()
    return loss, config, logits, parts, mask
