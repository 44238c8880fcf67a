#!/usr/bin/env python
"""One fine-tuning run of bench_finetune, in a process of its own (fresh memory, its own peak): ours (`mtnlg fit`'s
machinery: MTNLGModule + FineTuneDataModule) or TRL's SFTTrainer with peft, as the spec file says.

    python benchmarks/finetune_workers.py {ours,trl} SPEC.json OUT.json

Both sides: the same Hugging Face Llama directory, chat records and chat template (the assistant's tokens trained),
LoRA rank/alpha/targets, rows per step (one micro-batch per step), steps, row length, AdamW (lr, betas, weight
decay), clipping at 1.0, precision (fp32, or bf16 autocast over fp32 weights: Lightning's bf16-mixed, the
Trainer's bf16), threads and device. OUT.json is a `finetune_steps.StepLog`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the repository root: testing.*
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402
from finetune_steps import StepLog, labelled  # noqa: E402
from results import trl_training_args  # noqa: E402


def run_ours(spec: dict, log: StepLog) -> None:
    import lightning as L

    from mtnlg_lightning.data.finetune import FineTuneDataModule
    from mtnlg_lightning.data.packing import PADDING_DOCUMENT
    from mtnlg_lightning.train.module import MTNLGModule
    from mtnlg_lightning.train.step_interfaces import micro_batch_shapes
    from testing.lightning_run import quiet_trainer
    from testing.state_bytes import StateBytesProbe

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            log.start_memory()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            documents = batch["document_ids"]
            tokens = int((documents != PADDING_DOCUMENT).sum())
            # the positions the model computes: unpacked rows are cut to each micro-batch's longest
            shapes = micro_batch_shapes(batch, pl_module.micro_batch_size, pl_module.runner.row_multiple)
            positions = sum(rows * width for rows, width in shapes)
            examples = int((documents.max(dim=1).values + 1).sum())  # a row's documents are 0, 1, ...
            log.step(documents.shape[0], positions, tokens, labelled(batch["labels"]), examples)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            log.read_memory()

    L.seed_everything(spec["seed"], verbose=False)
    lora = spec["lora"]
    module = MTNLGModule(
        init_from=spec["model_dir"],
        model_overrides={"seq_len": spec["seq_len"]},
        micro_batch_size=spec["micro_batch"],
        global_batch_size=spec["micro_batch"] * spec.get("accumulate", 1),
        lr=spec["lr"],
        min_lr=spec["lr"],
        warmup_tokens=0,
        decay_tokens=10**15,
        weight_decay=spec["weight_decay"],
        betas=tuple(spec["betas"]),
        grad_clip=1.0,
        preemption=False,
        watchdog=False,
        straggler_every_n_steps=0,
        lora={"rank": lora["rank"], "alpha": lora["alpha"], "dropout": 0.0, "targets": lora["targets"]}
        if lora
        else None,
    )
    data = FineTuneDataModule(train=spec["records"], tokenizer=spec["model_dir"], pack=spec["pack"], seed=spec["seed"])
    probe = StateBytesProbe()
    trainer = quiet_trainer(
        accelerator="cuda" if log.device.startswith("cuda") else "cpu",
        devices=1,
        precision="bf16-mixed" if spec["precision"] == "bf16" else "32-true",
        max_steps=spec["steps"],
        log_every_n_steps=spec["steps"],
        callbacks=[Record(), probe],
    )
    trainer.fit(module, data)
    log.finish()
    log.extra["state_bytes"] = probe.result.as_dict()
    log.extra["trainable_parameters"] = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    log.extra["parameters"] = sum(p.numel() for p in module.model.parameters())


def run_trl(spec: dict, log: StepLog) -> None:
    import datasets
    import peft
    import transformers
    import trl

    from testing.state_bytes import grad_bytes, state_bytes

    class Record(transformers.TrainerCallback):
        def __init__(self):
            self.grads = 0

        def on_train_begin(self, args, state, control, **kwargs):
            log.start_memory()

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.grads = grad_bytes(model, optimizer)

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            log.extra["state_bytes"] = state_bytes(model, optimizer, grads=self.grads).as_dict()

    class RecordedSFTTrainer(trl.SFTTrainer):
        """SFTTrainer, noting each step's batch (one micro-batch per step: gradient_accumulation_steps 1)."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            ids = inputs["input_ids"]
            mask = inputs.get("attention_mask")
            # A padding-free batch (packing) is its rows flattened into one, with no mask and no padding: each
            # example's positions restart at 0.
            tokens = ids.numel() if mask is None else int(mask.sum())
            rows = spec["micro_batch"] if mask is None else ids.shape[0]
            examples = int((inputs["position_ids"] == 0).sum()) if mask is None else rows
            log.step(rows, ids.numel(), tokens, labelled(inputs["labels"]), examples)
            return super().training_step(model, inputs, num_items_in_batch)

    torch.manual_seed(spec["seed"])
    records = [json.loads(line) for line in open(spec["records"], encoding="utf-8")]
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model_dir"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa"
    )
    lora = spec["lora"]
    peft_config = None
    if lora:
        peft_config = peft.LoraConfig(
            r=lora["rank"],
            lora_alpha=lora["alpha"],
            lora_dropout=0.0,
            target_modules=lora["hf_targets"],
            task_type="CAUSAL_LM",
        )
    with tempfile.TemporaryDirectory() as out:
        config = trl.SFTConfig(
            **trl_training_args(out, spec["steps"], spec["lr"], spec["weight_decay"], spec["betas"], spec["seed"])
            | {"bf16": spec["precision"] == "bf16"},
            per_device_train_batch_size=spec["micro_batch"],
            max_length=spec["seq_len"],
            packing=spec["pack"],
            assistant_only_loss=True,
            gradient_checkpointing=False,  # SFTConfig's default is on: neither other trainer recomputes
            use_cpu=not log.device.startswith("cuda"),
            logging_steps=spec["steps"],
            report_to="none",
        )
        trainer = RecordedSFTTrainer(
            model=model,
            args=config,
            train_dataset=datasets.Dataset.from_list(records),
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[Record()],
        )
        trainer.train()
    log.finish()
    model = trainer.model
    log.extra["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.extra["parameters"] = sum(p.numel() for p in model.parameters())


def main() -> int:
    which, spec_path, out = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    log = StepLog(spec["device"])
    {"ours": run_ours, "trl": run_trl}[which](spec, log)
    log.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
