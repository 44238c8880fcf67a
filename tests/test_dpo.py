"""Preference tuning (`--model.objective dpo`): the DPO and IPO losses equal TRL's on the same model and batch (loss,
rewards, gradients), the first step with policy == reference is ln 2, LoRA's reference is its base with the adapters
off, and the preference data keeps a pair together, trains its answers only and names bad records in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from mtnlg_lightning.checkpoint.format import read_meta
from mtnlg_lightning.data.packing import GROUP_LENGTHS, ROW_LENGTHS
from mtnlg_lightning.data.preferences import PreferenceDataModule, encode_completion, pairs_batch, to_pair
from mtnlg_lightning.demo.synthetic.preferences import preference_examples, write_preferences
from mtnlg_lightning.dpo_loss import DPOConfig, PairRewards, pair_losses
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.interop.init_from import config_for_init, load_init_weights
from mtnlg_lightning.loss import IGNORE_INDEX
from mtnlg_lightning.model import build_model
from mtnlg_lightning.parallel.lora import LoRAConfig, LoRALinear, adapters_disabled, apply_lora
from mtnlg_lightning.train.module import MTNLGModule
from mtnlg_lightning.train.objectives import LanguageModelling, build_objective
from mtnlg_lightning.train.objectives.preference import PreferenceLoss, ReferenceLogps, SequenceScores, with_row_index

SEQ_LEN = 128


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A random Hugging Face Llama directory (grouped-query attention, untied head) with the demo tokenizer."""
    from hf_models import random_family_dir

    return random_family_dir(tmp_path_factory.mktemp("dpo_base"), "llama")


def our_model(directory: Path) -> torch.nn.Module:
    model = build_model(config_for_init(str(directory), "tiny", None))
    load_init_weights(model, str(directory))
    return model


# ------------------------------------------------------------------------------------------------ the settings
def objective_of(name: str, beta: float = 0.1, loss: str = "sigmoid", label_smoothing: float = 0.0):
    settings = {"objective": name, "dpo_beta": beta, "dpo_loss": loss, "dpo_label_smoothing": label_smoothing}
    return build_objective(settings)


def test_dpo_settings_are_checked_in_one_line_each():
    assert isinstance(objective_of("lm", 0.0, "hinge"), LanguageModelling)  # DPO's settings are DPO's alone
    assert objective_of("dpo", 0.1, "ipo").config == DPOConfig(0.1, "ipo")
    for beta in (0.0, -0.5):
        with pytest.raises(MTNLGError, match=r"dpo_beta must be a number > 0"):
            MTNLGModule(objective="dpo", dpo_beta=beta)
    with pytest.raises(MTNLGError, match="dpo_loss must be one of sigmoid, ipo"):
        objective_of("dpo", 0.1, "hinge")
    with pytest.raises(MTNLGError, match="objective must be one of lm, dpo, grpo"):
        objective_of("ppo")
    with pytest.raises(MTNLGError, match=r"label_smoothing must be in \[0, 0.5\)"):
        objective_of("dpo", 0.1, "sigmoid", 0.5)


def test_label_smoothing_is_cdpo():
    """cDPO: the loss of a pair whose label is flipped with probability e."""
    policy, reference = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.5])
    tokens = torch.tensor([3.0, 4.0])
    z = 0.5 * ((-3.0 + 4.0) - (-5.0 + 4.5))
    smoothed, _, _ = pair_losses(DPOConfig(0.5, "sigmoid", 0.2), policy, reference, tokens)
    expected = -0.8 * math.log(1 / (1 + math.exp(-z))) - 0.2 * math.log(1 / (1 + math.exp(z)))
    assert smoothed.item() == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------------------------------------ TRL
def preference_batch(pairs: int = 3, length: int = 24, vocab: int = 4096, seed: int = 0):
    """TRL's layout of a batch (every chosen row, then every rejected row; right padding; a completion mask) with
    prompts and completions of different lengths."""
    generator = torch.Generator().manual_seed(seed)
    rows = 2 * pairs
    input_ids = torch.randint(5, vocab, (rows, length), generator=generator)
    attention = torch.zeros(rows, length, dtype=torch.long)
    completion = torch.zeros(rows, length, dtype=torch.long)
    for row in range(rows):
        prompt = 4 + (row % pairs) * 2  # chosen and rejected of a pair share a prompt length
        end = length - int(torch.randint(0, 8, (), generator=generator))
        attention[row, :end] = 1
        completion[row, prompt:end] = 1
        input_ids[row, end:] = 0
        if row >= pairs:  # the rejected row repeats its chosen row's prompt
            input_ids[row, :prompt] = input_ids[row - pairs, :prompt]
    return input_ids, attention, completion


def ours_from_trl(input_ids, completion):
    """The same pairs as our batch: interleaved rows (chosen, rejected, ...) with labels on the completion tokens
    (each position labelled with the next token where that token is part of the completion)."""
    pairs = len(input_ids) // 2
    order = [i for p in range(pairs) for i in (p, p + pairs)]
    ids, mask = input_ids[order], completion[order]
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], IGNORE_INDEX)
    return ids, labels


def trl_trainer(policy_dir: Path, reference_dir: Path, tmp_path: Path, loss_type: str, beta: float):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer

    load = transformers.AutoModelForCausalLM.from_pretrained
    policy, reference = load(policy_dir, dtype=torch.float32), load(reference_dir, dtype=torch.float32)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(policy_dir / "tokenizer.json"), eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    args = TRLConfig(
        output_dir=str(tmp_path / "trl"),
        beta=beta,
        loss_type=[loss_type],
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL's default runs the reference under bf16 autocast where the CPU has bf16
        save_strategy="no",
    )
    dataset = Dataset.from_list([{"prompt": "a b", "chosen": " c", "rejected": " d"}] * 2)
    return DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=dataset, processing_class=tokenizer)


@pytest.fixture(scope="module")
def policy_dir(base_dir, tmp_path_factory) -> Path:
    """The base moved away (the policy after some training): the reference (the base) and the policy differ."""
    import shutil

    import transformers

    out = tmp_path_factory.mktemp("dpo_policy") / "policy"
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(out)
    shutil.copy(base_dir / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_rewards_and_gradients_equal_trls(loss_type, base_dir, policy_dir, tmp_path):
    """On the same Llama weights and batch, `DPOTrainer._compute_loss` (TRL, pinned in the dev extra) and ours give
    the same loss, rewards and parameter gradients (fp32, 1e-5)."""
    from mtnlg_lightning import families

    beta = 0.3
    trainer = trl_trainer(policy_dir, base_dir, tmp_path, loss_type, beta)
    input_ids, attention, completion = preference_batch()
    inputs = {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}
    trl_loss = trainer._compute_loss(trainer.model, inputs, False)
    trl_loss.backward()
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    hf_grads = {name: p.grad for name, p in trainer.model.named_parameters()}

    policy, reference = our_model(policy_dir), our_model(base_dir)
    ids, labels = ours_from_trl(input_ids, completion)
    target = with_row_index(labels)
    collector = ReferenceLogps(SequenceScores(), len(ids), ids.device)
    with torch.no_grad():
        collector(reference(ids), target)
    rewards = PairRewards(len(ids) // 2, ids.device)
    loss = PreferenceLoss(DPOConfig(beta, loss_type), SequenceScores(), collector.logps, rewards)(policy(ids), target)
    loss.backward()

    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    ours = PairRewards.means(rewards.totals)
    assert ours["rewards/chosen"].item() == pytest.approx(metrics["rewards/chosen"][-1], rel=1e-5, abs=1e-5)
    assert ours["rewards/rejected"].item() == pytest.approx(metrics["rewards/rejected"][-1], rel=1e-5, abs=1e-5)
    assert ours["rewards/margin"].item() == pytest.approx(metrics["rewards/margins"][-1], rel=1e-5, abs=1e-5)
    assert ours["rewards/accuracy"].item() == pytest.approx(metrics["rewards/accuracies"][-1])
    config = policy.config
    compared = 0
    for name, sources in families.hf_tensors(families.family_of(config), config).items():
        if len(sources) != 1:
            continue
        theirs = hf_grads[sources[0]]  # within 1e-5 of the tensor's largest gradient (fp32 sums in another order)
        torch.testing.assert_close(policy.get_parameter(name).grad, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max())
        compared += 1
    assert compared == len(list(policy.parameters()))


# ------------------------------------------------------------------------------------------------ LoRA's reference
def test_the_lora_reference_is_the_base_with_the_adapters_off(base_dir):
    """With trained (non-zero) adapters the policy differs from the base; with them off its log-probs are the base
    model's, bit for bit (no second copy: the same modules)."""
    base = our_model(base_dir)
    adapted = our_model(base_dir)
    apply_lora(adapted, LoRAConfig(rank=4, alpha=8.0))
    with torch.no_grad():
        for module in adapted.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.normal_(0.0, 0.05)
    input_ids, _, completion = preference_batch(pairs=2)
    ids, labels = ours_from_trl(input_ids, completion)
    target = with_row_index(labels)

    def logps(model):
        collector = ReferenceLogps(SequenceScores(), len(ids), ids.device)
        with torch.no_grad():
            collector(model(ids), target)
        return collector.logps

    expected = logps(base)
    assert not torch.allclose(logps(adapted), expected)
    with adapters_disabled(adapted):
        torch.testing.assert_close(logps(adapted), expected, rtol=0, atol=0)
    assert all(m.enabled for m in adapted.modules() if isinstance(m, LoRALinear))  # back on after


# ------------------------------------------------------------------------------------------------ a fit
def dpo_fit(
    base_dir: Path,
    tmp_path: Path,
    steps: int,
    lora: dict | None = None,
    callbacks=(),
    ckpt_path=None,
    precompute_reference: bool = False,
    **module_args,
):
    from testing.lightning_run import quiet_trainer

    train = write_preferences(tmp_path / "prefs.jsonl", 64)
    L.seed_everything(1234, verbose=False)
    module = MTNLGModule(
        preset="tiny",
        init_from=str(base_dir),
        model_overrides={"seq_len": SEQ_LEN},
        micro_batch_size=2,
        global_batch_size=4,
        lr=1e-3,
        warmup_tokens=0,
        objective="dpo",
        lora=lora,
        preemption=False,
        watchdog=False,
        straggler_every_n_steps=0,
        **module_args,
    )
    data = PreferenceDataModule(train=str(train), chat_template="chatml", precompute_reference=precompute_reference)
    logged = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    checkpointing = any(isinstance(cb, L.pytorch.callbacks.ModelCheckpoint) for cb in callbacks)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[Record(), *callbacks],
        enable_checkpointing=checkpointing,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return logged, module


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8}], ids=["full", "lora"])
def test_the_first_step_loss_is_ln2_and_the_rewards_are_logged(lora, base_dir, tmp_path):
    """Policy == reference at the first step: every log-ratio is 0, the loss ln 2 and the rewards 0; after updates
    the policy moves away from its reference."""
    logged, _ = dpo_fit(base_dir, tmp_path, 3, lora)
    assert logged[0]["train_loss"] == pytest.approx(math.log(2), abs=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert logged[0][name] == pytest.approx(0.0, abs=1e-6)
        assert name in logged[-1]
    assert logged[-1]["rewards/chosen"] != 0.0 and 0.0 <= logged[-1]["rewards/accuracy"] <= 1.0


@pytest.mark.slow
def test_the_reference_pass_of_a_lora_fit_equals_the_base_model(base_dir, tmp_path):
    """After adapter updates, the step's reference log-probs are the base model's (loaded on its own), not the
    adapted policy's."""
    seen = {}

    class CompareReference(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step != 3:
                return
            targeted = {**batch, "labels": with_row_index(batch["labels"])}
            seen["step"] = module.objective.reference_logps(module, targeted, 2 * module.micro_batch_size)
            base = our_model(base_dir)
            collector = ReferenceLogps(SequenceScores(), len(batch["labels"]), batch["labels"].device)
            with torch.no_grad():
                collector(base(batch["input_ids"], position_ids=batch["position_ids"]), targeted["labels"])
            seen["base"] = collector.logps
            with torch.no_grad():
                policy = ReferenceLogps(SequenceScores(), len(batch["labels"]), batch["labels"].device)
                policy(module.model(batch["input_ids"], position_ids=batch["position_ids"]), targeted["labels"])
            seen["policy"] = policy.logps

    dpo_fit(base_dir, tmp_path, 3, {"rank": 4, "alpha": 8}, callbacks=[CompareReference()])
    torch.testing.assert_close(seen["step"], seen["base"], rtol=1e-6, atol=1e-5)
    assert not torch.allclose(seen["policy"], seen["base"], rtol=1e-6, atol=1e-5)


@pytest.mark.slow
def test_a_resumed_full_weight_run_keeps_the_starting_weights_as_its_reference(base_dir, tmp_path):
    """The reference is copied before the checkpoint is restored: steps 3 and 4 after a resume from step 2 are
    those of the run that never stopped (with the resumed policy as reference, step 3 would start at ln 2)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    straight, _ = dpo_fit(base_dir, tmp_path / "straight", 4)
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    dpo_fit(base_dir, tmp_path / "first", 2, callbacks=[saving])
    resumed, _ = dpo_fit(base_dir, tmp_path / "second", 4, ckpt_path=tmp_path / "ckpt" / "step=2.ckpt")
    assert len(resumed) == 2
    for after, before in zip(resumed, straight[2:], strict=True):
        assert after["train_loss"] == pytest.approx(before["train_loss"], rel=1e-6)
        assert after["rewards/margin"] == pytest.approx(before["rewards/margin"], rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_precomputed_reference_log_probs_need_no_copy_travel_in_the_checkpoint_and_a_resume_reads_them(
    base_dir, tmp_path
):
    """Full-weight DPO with data.precompute_reference keeps no reference copy and trains as the run with one (the
    log-probs of every pair, computed before the first step, are the starting model's). Its checkpoints hold them:
    a resume from step 2 continues the uninterrupted losses (the restored weights are not the reference); a
    checkpoint saved without them is refused in one line."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def saving(folder):
        return ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=2, save_top_k=-1, filename="{step}")

    with_copy, _ = dpo_fit(base_dir, tmp_path / "copy", 4, callbacks=[saving("plain")])
    straight, module = dpo_fit(base_dir, tmp_path / "straight", 4, precompute_reference=True)
    assert module.objective.reference_weights is None
    for ours, theirs in zip(straight, with_copy, strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-6)
        assert ours["rewards/margin"] == pytest.approx(theirs["rewards/margin"], rel=1e-5, abs=1e-7)

    dpo_fit(base_dir, tmp_path / "first", 2, callbacks=[saving("ckpt")], precompute_reference=True)
    stored = read_meta(tmp_path / "ckpt" / "step=2.ckpt")
    assert stored["dpo_reference_logps"]["train"].shape == (2 * 64,)
    resumed, _ = dpo_fit(
        base_dir, tmp_path / "second", 4, ckpt_path=tmp_path / "ckpt" / "step=2.ckpt", precompute_reference=True
    )
    assert len(resumed) == 2
    for after, before in zip(resumed, straight[2:], strict=True):
        assert after["train_loss"] == pytest.approx(before["train_loss"], rel=1e-6)
    with pytest.raises(MTNLGError, match="holds no precomputed reference log-probabilities"):
        plain = tmp_path / "plain" / "step=2.ckpt"
        dpo_fit(base_dir, tmp_path / "third", 4, ckpt_path=plain, precompute_reference=True)


@pytest.mark.slow
def test_a_lora_dpo_checkpoint_exports_a_peft_adapter_with_the_trained_logits(base_dir, tmp_path):
    """`mtnlg-export-hf CKPT OUT --adapter` on a LoRA-DPO checkpoint, as on a fine-tuning one: PEFT loads the adapter
    on the base directory and gives the logits of the policy the run trained (not the base's)."""
    import peft
    import transformers
    from lightning.pytorch.callbacks import ModelCheckpoint

    from mtnlg_lightning.interop.export_cli import main as export_main

    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    _, module = dpo_fit(base_dir, tmp_path, 3, {"rank": 4, "alpha": 8}, callbacks=[saving])
    assert export_main([str(tmp_path / "ckpt" / "step=3.ckpt"), str(tmp_path / "adapter"), "--adapter"]) == 0
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(tokens).logits
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(tokens).logits
        ours = module.model.eval()(tokens)[..., : theirs.shape[-1]]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, ours, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ data
CHATML_DIR_TEMPLATE = "chatml"


def chat(base_dir):
    from mtnlg_lightning.data.chat_template import ChatTokenizer

    return ChatTokenizer(base_dir, CHATML_DIR_TEMPLATE)


def test_record_forms_become_pairs():
    text = to_pair({"prompt": "Hi?", "chosen": "Yes.", "rejected": "No."}, "f:1")
    assert text.prompt == [{"role": "user", "content": "Hi?"}]
    assert text.chosen == [{"role": "assistant", "content": "Yes."}]
    shared = [{"role": "user", "content": "Hi?"}]
    turns = to_pair({"messages": shared, "chosen": [{"role": "assistant", "content": "A"}], "rejected": "B"}, "f:2")
    assert turns.prompt == shared and turns.rejected == [{"role": "assistant", "content": "B"}]
    implicit = to_pair(
        {
            "chosen": [*shared, {"role": "assistant", "content": "A"}],
            "rejected": [*shared, {"role": "assistant", "content": "B"}],
        },
        "f:3",
    )
    assert implicit.prompt == shared and implicit.chosen == [{"role": "assistant", "content": "A"}]


def test_a_record_without_chosen_or_rejected_names_the_fields_seen():
    with pytest.raises(MTNLGError, match=r"^f:7: a preference record needs chosen and rejected \(fields: chosen, "):
        to_pair({"chosen": "A", "prompt": "Q", "score": 1}, "f:7")
    with pytest.raises(MTNLGError, match="has no prompt"):
        to_pair({"chosen": "A", "rejected": "B"}, "f:8")


def test_only_the_answer_trains_not_an_assistant_turn_of_the_prompt(base_dir):
    prompt = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another?"},
    ]
    encoded, prompt_tokens = encode_completion(chat(base_dir), prompt, [{"role": "assistant", "content": "Blue."}])
    trained = [i for i, flag in enumerate(encoded.trained) if flag]
    assert trained and min(trained) >= prompt_tokens  # "Red." is in the prompt: not scored
    text = chat(base_dir).tokenizer.decode([encoded.ids[i] for i in trained])
    assert "Blue." in text and "Red" not in text


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def setup_data(base_dir: Path, train: Path, seq_len: int = SEQ_LEN, pairs: int = 4):
    from types import SimpleNamespace

    module = MTNLGModule(
        preset="tiny",
        init_from=str(base_dir),
        model_overrides={"seq_len": seq_len},
        micro_batch_size=2,
        global_batch_size=pairs,
        objective="dpo",
    )
    data = PreferenceDataModule(train=str(train), chat_template="chatml")
    data.trainer = SimpleNamespace(lightning_module=module, max_steps=2, strategy=None, global_rank=0, world_size=1)
    data.setup("fit")
    return data


def test_identical_answers_are_counted_and_skipped_and_a_long_prompt_is_one_line(base_dir, tmp_path, capsys):
    records = preference_examples(6)
    records[2] = {**records[2], "rejected": records[2]["chosen"]}
    data = setup_data(base_dir, write_records(tmp_path / "p.jsonl", records))
    assert data.skipped["train"] == {"identical": 1}
    assert len(data.splits["train"].pairs) == 5
    assert "skipped 1 of 6 pairs (1 chosen equal to rejected)" in capsys.readouterr().out
    long = [{"prompt": "word " * 200, "chosen": "A", "rejected": "B"}]
    with pytest.raises(MTNLGError, match=r"p2.jsonl:1: the prompt takes \d+ tokens, leaving no room"):
        setup_data(base_dir, write_records(tmp_path / "p2.jsonl", long))


def test_a_pair_stays_together_chosen_then_rejected(base_dir, tmp_path):
    """Rows 2i and 2i + 1 of a batch are the chosen and rejected answers of one pair: same prompt, labels only on
    the answers; a micro-batch of 2 x micro_batch_size rows never splits a pair."""
    data = setup_data(base_dir, write_preferences(tmp_path / "p.jsonl", 12))
    batch = pairs_batch([data.splits["train"][i] for i in range(4)])
    assert batch["input_ids"].shape == (8, SEQ_LEN)
    assert set(batch) == {"input_ids", "labels", "position_ids", ROW_LENGTHS, GROUP_LENGTHS}
    for pair in range(4):
        chosen, rejected = batch["labels"][2 * pair], batch["labels"][2 * pair + 1]
        first = int((chosen != IGNORE_INDEX).nonzero()[0])
        assert first == int((rejected != IGNORE_INDEX).nonzero()[0])  # the answers start after the same prompt
        assert torch.equal(batch["input_ids"][2 * pair, : first + 1], batch["input_ids"][2 * pair + 1, : first + 1])
        assert not torch.equal(chosen, rejected)


def test_preference_data_needs_the_dpo_objective(base_dir, tmp_path):
    from types import SimpleNamespace

    module = MTNLGModule(preset="tiny", init_from=str(base_dir), model_overrides={"seq_len": SEQ_LEN})
    data = PreferenceDataModule(train=str(write_preferences(tmp_path / "p.jsonl", 4)), chat_template="chatml")
    data.trainer = SimpleNamespace(lightning_module=module, max_steps=2, strategy=None, global_rank=0, world_size=1)
    with pytest.raises(MTNLGError, match="set model.objective dpo"):
        data.setup("fit")


# ------------------------------------------------------------------------------------------------ layouts
# world 2: zeroN is dp2; _precomputed: full weights, the reference log-probs computed before the first step
DPO_LAYOUTS = (
    "tp2",
    "tp2_sp",
    "pp2",
    "zero1",
    "cp2",
    "pp2_lora",
    "zero3_lora",
    "cp2_lora",
    "pp2_precomputed",
    "zero3_precomputed",
)


@pytest.fixture(scope="module")
def dpo_runs(base_dir, tmp_path_factory):
    """5 DPO steps from the Llama directory, full-weight and LoRA: one process, then the layouts in one 2-rank
    torchrun launch."""
    from dist_dpo_runs import DPO_LORA, dpo_run

    from testing.local_ranks import run_on_ranks

    root = tmp_path_factory.mktemp("dpo_runs")
    pairs = str(write_preferences(root / "pairs.jsonl", 64))
    runs = {"one": dpo_run(str(base_dir), pairs), "one_lora": dpo_run(str(base_dir), pairs, lora=DPO_LORA)}
    here = Path(__file__).resolve().parent
    out = root / "layouts"
    proc = run_on_ranks(2, here / "dist_dpo_runs.py", out, base_dir, pairs, *DPO_LAYOUTS, timeout=900, cwd=here.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return runs | {name: torch.load(out / f"{name}.pt", weights_only=False) for name in DPO_LAYOUTS}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", DPO_LAYOUTS)
def test_dpo_trains_alike_in_every_layout(layout, dpo_runs):
    """tp2 (vocabulary-parallel log-probs) with and without sequence parallelism, pp2 (the pairs' log-probs summed
    on the last stage; the reference pass through the same schedule), dp2 ZeRO-1 (a pair on one rank) and cp2 (each
    rank scores its chunks of every row, the parts summed over the ring's group), LoRA-DPO (the reference: adapters
    off) in pp2, dp2 ZeRO-3 and cp2, and full-weight DPO with precomputed reference log-probs (no copy: the
    reference pass over every pair before the first step, through the pipeline schedule, or under ZeRO-3) reproduce
    one process: losses (rel 1e-5), the logged rewards, pre-clip gradient norms and the weights after 5 clipped Adam
    steps. The norms are compared at 5e-5: one process reports torch's fp32 `clip_grad_norm_`, 2e-5 off the fp64
    norm of the same gradients (which the layouts' `parallel.clip` computes) on this model."""
    run, one = dpo_runs[layout], dpo_runs["one_lora" if layout.endswith("_lora") else "one"]
    assert one["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    torch.testing.assert_close(run["losses"], one["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(run["rewards"], one["rewards"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(run["grad_norms"], one["grad_norms"], rtol=5e-5, atol=0)
    params, expected = run["params"][5], one["params"][5]
    assert params.keys() == expected.keys()
    assert max((params[k] - expected[k]).abs().max().item() for k in expected) <= 2e-5
