"""GRPO against TRL 1.16's GRPOTrainer, beyond the loss core (test_grpo_loss.py): with LoRA adapters (peft's on
TRL's side, ours on ours, the same weights), the loss and every adapter's gradient equal TRL's for each loss type,
importance-sampling level, KL weight and old log-probs; and one optimizer step from the same batch and weights, full
or LoRA, gives TRL's parameters. fp32 on the CPU, the tiny random Llama and hand-built batch of grpo_trl.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from grpo_trl import (
    CASES,
    COMPLETION,
    hand_built_batch,
    llama_directory,
    our_loss,
    our_model,
    policy_logps,
    trl_case_inputs,
    trl_loss,
    trl_trainer,
)

from mtnlg_lightning import families
from mtnlg_lightning.parallel.lora import LoRAConfig, adapters_disabled
from mtnlg_lightning.train.optimizer_recipe import build_adamw
from mtnlg_lightning.train.step_interfaces import LocalRunner

pytest.importorskip("trl")
pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0  # scale alpha / rank = 2
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # both sides take these
# Our adapted module inside a block -> peft's inside a Llama layer, written out here (not read from families.py).
LORA_MODULES = {
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.proj": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}
ADAPTERS = 2 * len(LORA_MODULES) * 2  # 2 layers x 7 projections x (A, B)


def peft_name(name: str) -> str:
    """`blocks.1.attn.q.lora_a` -> `base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight`."""
    _, layer, rest = name.split(".", 2)
    module, _, matrix = rest.rpartition(".")
    return f"base_model.model.model.layers.{layer}.{LORA_MODULES[module]}.lora_{matrix[-1].upper()}.default.weight"


def counterparts(ours: torch.nn.Module, theirs: torch.nn.Module) -> dict[str, tuple]:
    """Every parameter that trains on our side -> (it, TRL's parameter of the same tensor): the adapters under LoRA
    (peft_name), else every weight (families.py's map to Hugging Face's names)."""
    trained = {name: param for name, param in ours.named_parameters() if param.requires_grad}
    if len(trained) < len(list(ours.parameters())):  # LoRA
        names = {name: peft_name(name) for name in trained}
    else:
        mapping = families.hf_tensors(families.family_of(ours.config), ours.config)
        names = {name: sources[0] for name, sources in mapping.items()}
    assert set(names) == set(trained)
    return {name: (trained[name], theirs.get_parameter(their)) for name, their in names.items()}


def labelled(label: str):
    """assert_close's message, prefixed with `label`."""
    return lambda message: f"{label}: {message}"


def lora_pair(llama_dir, output_dir, **settings):
    """TRL's trainer with peft's LoRA (rank, alpha, targets as ours, no dropout) and our model with ours, on the same
    base; peft's initial A copied into ours, B drawn non-zero (so A's gradient is not zero) into both."""
    import peft

    lora = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS), task_type="CAUSAL_LM"
    )
    trainer = trl_trainer(llama_dir, output_dir, peft_config=lora, **settings)
    ours = our_model(llama_dir, LoRAConfig(RANK, ALPHA, 0.0, TARGETS))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, (our_param, their_param) in counterparts(ours, trainer.model).items():
            if name.endswith("lora_b"):
                assert not their_param.any()  # peft's start, as ours
                their_param.copy_(0.05 * torch.randn(their_param.shape, generator=generator))
            our_param.copy_(their_param)
    return trainer, ours


def lora_batch(trainer, ours):
    """The hand-built batch from the LoRA policy, each side's reference its base (adapters off): ours by
    `adapters_disabled`, TRL's as `_generate_and_score_completions` computes it with peft (`use_adapter(model,
    None)`). Returns (TRL's inputs, ids, labels, old, our reference, TRL's reference)."""
    from trl.trainer.utils import use_adapter

    trl_inputs, ids, labels, old, _ = hand_built_batch(ours, trainer.processing_class.pad_token_id)
    with adapters_disabled(ours):
        our_ref = policy_logps(ours, ids, labels)
    ids_trl = torch.cat([trl_inputs["prompt_ids"], trl_inputs["completion_ids"]], dim=1)
    attention = torch.cat([trl_inputs["prompt_mask"], trl_inputs["completion_mask"]], dim=1)
    with torch.no_grad(), use_adapter(trainer.model, adapter_name=None):
        their_ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids_trl, attention, COMPLETION)
    their_ref = their_ref * trl_inputs["completion_mask"]
    torch.testing.assert_close(our_ref, their_ref, rtol=1e-5, atol=1e-6)
    return trl_inputs, ids, labels, old, our_ref, their_ref


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return llama_directory(tmp_path_factory)


@pytest.fixture(scope="module")
def lora(llama_dir, tmp_path_factory):
    """(TRL's trainer with peft's adapters, our model with ours, the batch), built once."""
    trainer, ours = lora_pair(llama_dir, tmp_path_factory.mktemp("trl"))
    return trainer, ours, lora_batch(trainer, ours)


# ------------------------------------------------------------------------------------------------ LoRA gradients
@pytest.mark.parametrize("loss_type, level, beta, old", CASES)
def test_lora_loss_and_every_adapter_gradient_equal_trls_with_peft(loss_type, level, beta, old, lora):
    """TRL's `_compute_loss` on its peft model and ours on our LoRA model: the same loss (1e-5) and every adapter's
    gradient (within 1e-5 of the tensor's largest), none zero; the frozen bases get none on either side. With
    beta > 0 the reference is the base with adapters off on both sides."""
    case = (loss_type, level, beta, old)
    trainer, ours, (trl_inputs, ids, labels, old_logp, our_ref, their_ref) = lora
    trl_value, _ = trl_loss(trainer, trl_case_inputs(trainer, trl_inputs, old_logp, their_ref, case))
    loss, _, _, parts, _ = our_loss(ours, ids, labels, old_logp, our_ref, case)

    torch.testing.assert_close(loss, trl_value, rtol=1e-5, atol=1e-7)
    pairs = counterparts(ours, trainer.model)
    for name, (our_param, their_param) in pairs.items():
        expected = their_param.grad
        assert expected.abs().max() > 0, name
        tolerance = 1e-5 * expected.abs().max()
        torch.testing.assert_close(our_param.grad, expected, rtol=1e-5, atol=tolerance, msg=labelled(name))
    assert len(pairs) == ADAPTERS == sum(p.requires_grad for p in trainer.model.parameters())
    assert all(p.grad is None for p in ours.parameters() if not p.requires_grad)
    assert all(p.grad is None for p in trainer.model.parameters() if not p.requires_grad)
    if old == "perturbed":  # the clipped branch is exercised
        assert parts["clipped_low"].any() and parts["clipped_high"].any()


# ------------------------------------------------------------------------------------------------ update steps
# eps 1e-5, not 1e-8: Adam's first step is lr * g / (|g| + eps), so at an element whose gradient is near eps the fp32
# rounding of the two models' gradients (up to 6e-8 here, within 1e-5 of each tensor's largest) becomes lr * dg / eps:
# at 1e-8 a handful of the 600k weights differ by up to 3e-5 (at 1e-5: 2e-6). With eps well above the rounding the
# step also depends on the clipping's scale (Adam cancels it otherwise): without our clipping it is off by 2e-3.
LR, BETAS, EPS, WEIGHT_DECAY, MAX_NORM = 1e-2, (0.9, 0.95), 1e-5, 0.1, 0.2
# TrainingArguments of the same steps: the default optimizer (AdamW, torch's fused kernel), constant lr; two passes
# over each generated batch, so that the second step reuses the first's inputs (its stored old log-probs)
STEP = dict(
    learning_rate=LR,
    adam_beta1=BETAS[0],
    adam_beta2=BETAS[1],
    adam_epsilon=EPS,
    weight_decay=WEIGHT_DECAY,
    max_grad_norm=MAX_NORM,
    lr_scheduler_type="constant",
    warmup_steps=0,
    num_iterations=2,
)


def trl_stepper(trainer, inputs: dict):
    """Optimizer steps as Trainer's training loop takes them: the optimizer of `create_optimizer`; each step
    `training_step` (its `_prepare_inputs` shuffles and buffers what `_generate_and_score_completions` returns, here
    patched to return `inputs`, and replays it num_iterations times), the clipping by max_grad_norm,
    `optimizer.step()`, `zero_grad()`. Returns the step, which returns the pre-clip gradient norm."""
    trainer.create_optimizer()
    generated = []

    def generate_and_score(rows):
        generated.append(rows)
        return dict(inputs)

    trainer._generate_and_score_completions = generate_and_score
    rows = [{"prompt": "unused"}] * len(inputs["advantages"])

    def step() -> torch.Tensor:
        trainer.training_step(trainer.model, rows, inputs["num_items_in_batch"])
        assert len(generated) == 1  # the second step replays the buffered batch
        norm = trainer._clip_grad_norm(trainer.model)
        trainer.optimizer.step()
        trainer.model.zero_grad()
        return norm

    return step


def our_stepper(model, ids, labels, old, ref, case):
    """Steps as the module takes them under Lightning's own strategies: `build_adamw`; each step the GRPO loss's
    backward, `LocalRunner.update` (clipping by the norm), the update applied (Lightning's strategy stubbed to a
    plain `optimizer.step()`). Returns (the step, which returns the pre-clip norm; the optimizer)."""
    optimizer = build_adamw(model, LR, WEIGHT_DECAY, BETAS, EPS, fused=None)
    runner = LocalRunner(SimpleNamespace(model=model), SimpleNamespace(optimizer_step=lambda opt, closure: opt.step()))

    def step() -> torch.Tensor:
        our_loss(model, ids, labels, old, ref, case)
        update = runner.update(optimizer, MAX_NORM, undoable=False)
        update.finish(vetoed=False)
        return update.grad_norm

    return step, optimizer


def decayed(optimizer: torch.optim.Optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups if group["weight_decay"] > 0 for p in group["params"]}


@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize(
    "loss_type, level, beta, old", [("dapo", "token", 0.04, "perturbed"), ("grpo", "sequence", 0.0, "on-policy")]
)
def test_update_steps_give_trls_parameters(loss_type, level, beta, old, kind, llama_dir, tmp_path):
    """From the same weights and batch, AdamW steps on each side (lr 1e-2, betas (0.9, 0.95), eps 1e-5, weight
    decay 0.1, clipping at a norm below the gradient's): after one step, and after a second on the same batch (TRL's
    num_iterations 2), TRL's training steps and ours give the same pre-clip norm and every trained parameter within
    1e-5, each having moved. The betas show from the second step only (bias-corrected, the first is g / (|g| + eps)).
    The decayed parameters are the same on both sides (Trainer's: all but biases and norms, by name; ours: the
    matrices and embeddings), and TRL's frozen base stays."""
    case = (loss_type, level, beta, old)
    if kind == "lora":
        trainer, ours = lora_pair(llama_dir, tmp_path, **STEP)
        trl_inputs, ids, labels, old_logp, our_ref, their_ref = lora_batch(trainer, ours)
    else:
        trainer, ours = trl_trainer(llama_dir, tmp_path, **STEP), our_model(llama_dir)
        trl_inputs, ids, labels, old_logp, our_ref = hand_built_batch(ours, trainer.processing_class.pad_token_id)
        their_ref = our_ref
    pairs = counterparts(ours, trainer.model)
    before = {name: our_param.detach().clone() for name, (our_param, _) in pairs.items()}
    frozen = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if not p.requires_grad}
    their_step = trl_stepper(trainer, trl_case_inputs(trainer, trl_inputs, old_logp, their_ref, case))
    our_step, optimizer = our_stepper(ours, ids, labels, old_logp, our_ref, case)

    assert {name for name, (p, _) in pairs.items() if id(p) in decayed(optimizer)} == {
        name for name, (_, p) in pairs.items() if id(p) in decayed(trainer.optimizer)
    }
    for step in (1, 2):
        their_norm, our_norm = their_step(), our_step()
        torch.testing.assert_close(our_norm, their_norm, rtol=1e-5, atol=0)
        assert our_norm > MAX_NORM  # the clipping is in play
        for name, (our_param, their_param) in pairs.items():
            assert step > 1 or (our_param - before[name]).abs().max() > 1e-3, name
            torch.testing.assert_close(our_param, their_param, rtol=0, atol=1e-5, msg=labelled(f"step {step}, {name}"))
    for name, value in frozen.items():
        assert torch.equal(trainer.model.get_parameter(name), value), name
