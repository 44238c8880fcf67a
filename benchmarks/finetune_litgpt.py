#!/usr/bin/env python
"""litgpt's side of bench_finetune, run by the Python of a separate virtual environment that holds litgpt (its
pins of huggingface_hub and jsonargparse differ from this project's):

    VENV/bin/python benchmarks/finetune_litgpt.py convert HF_DIR LIT_DIR OUT.json
    VENV/bin/python benchmarks/finetune_litgpt.py run SPEC.json OUT.json

`convert` copies the Hugging Face Llama directory and converts it with litgpt's own converter
(`convert_hf_checkpoint`; the shape is registered as a litgpt config first, as litgpt knows only published models
by name), then checks that litgpt's logits equal transformers' on the same tokens (OUT.json: the largest
difference). `run` trains with `litgpt.finetune.lora` (its `setup`, as `litgpt finetune_lora` calls it) on the
benchmark's records in litgpt's single-turn form (`instruction`: the chat template's rendering of the system and
user turns, `output`: the assistant's text; litgpt masks the prompt and appends the end-of-turn token), one
micro-batch per step, noting each step's batch (`finetune_steps.StepLog`). litgpt pads each batch to its longest
example and cannot pack; its LoRA recipe has no gradient clipping and a linear warm-up (1 step here).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from finetune_steps import StepLog, labelled  # noqa: E402

CONFIG_NAME = "bench-llama"
# Ours / Hugging Face's projection names -> litgpt's LoRA switches.
LITGPT_SWITCHES = {
    "q_proj": "lora_query",
    "k_proj": "lora_key",
    "v_proj": "lora_value",
    "o_proj": "lora_projection",
    "gate_proj": "lora_mlp",
    "up_proj": "lora_mlp",
    "down_proj": "lora_mlp",
}


def litgpt_config(hf: dict) -> dict:
    """A litgpt config entry for a Hugging Face LlamaConfig (plain RoPE, no scaling)."""
    if hf.get("rope_scaling"):
        raise SystemExit("finetune_litgpt: the benchmark's Llama has plain RoPE; a rope_scaling is not mapped here")
    return dict(
        name=CONFIG_NAME,
        hf_config=dict(org="bench", name=CONFIG_NAME),
        block_size=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"],
        padded_vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"],
        n_embd=hf["hidden_size"],
        n_head=hf["num_attention_heads"],
        n_query_groups=hf["num_key_value_heads"],
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=hf["rms_norm_eps"],
        mlp_class_name="LLaMAMLP",
        intermediate_size=hf["intermediate_size"],
        rope_base=int(hf.get("rope_theta") or hf.get("rope_parameters", {}).get("rope_theta")),
    )


def convert(hf_dir: Path, lit_dir: Path, out: Path) -> None:
    import litgpt.config
    import transformers
    from litgpt.model import GPT
    from litgpt.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    shutil.copytree(hf_dir, lit_dir)
    hf = json.loads((hf_dir / "config.json").read_text())
    entry = litgpt_config(hf)
    litgpt.config.configs.append(entry)
    litgpt.config.name_to_config[CONFIG_NAME] = entry
    convert_hf_checkpoint(lit_dir, model_name=CONFIG_NAME)
    config = litgpt.config.Config.from_file(lit_dir / "model_config.yaml")
    ours = GPT(config)
    ours.load_state_dict(torch.load(lit_dir / "lit_model.pth", weights_only=True))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, hf["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine, reference = ours.eval()(tokens), theirs(tokens).logits
    difference = (mine - reference).abs().max().item()
    out.write_text(json.dumps({"max_logit_difference": difference, "max_abs_logit": reference.abs().max().item()}))


def run(spec: dict, out: Path) -> None:
    import litgpt.finetune.lora as lit
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON
    from litgpt.prompts import Default

    torch.set_num_threads(spec["threads"])
    log = StepLog(spec["device"])

    class RecordedLoader:
        """The train loader, noting each batch as the loop takes it (one micro-batch per step)."""

        def __init__(self, loader):
            self.loader, self.dataset = loader, loader.dataset

        def __len__(self):
            return len(self.loader)

        def __iter__(self):
            for batch in self.loader:
                ids = batch["input_ids"]
                tokens = int(batch["token_counts"]["raw_plus_prompt_template"].sum())
                log.step(ids.shape[0], ids.numel(), tokens, labelled(batch["labels"]))
                yield batch

    get_dataloaders, fit = lit.get_dataloaders, lit.fit

    def recorded_dataloaders(*args, **kwargs):
        train, valid = get_dataloaders(*args, **kwargs)
        return RecordedLoader(train), valid

    def recorded_fit(*args, **kwargs):
        model = kwargs["model"]
        log.extra["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log.extra["parameters"] = sum(p.numel() for p in model.parameters())
        log.start_memory()
        counts = fit(*args, **kwargs)
        log.finish()
        return counts

    lit.get_dataloaders, lit.fit = recorded_dataloaders, recorded_fit
    # After the measured loop: the merged copy is not benchmarked, and the hyperparameter file re-parses sys.argv
    # as litgpt's own command line.
    lit.merge_lora = lambda **kwargs: None
    lit.save_hyperparameters = lambda *args, **kwargs: None
    lora = spec["lora"]
    switches = {name: False for name in set(LITGPT_SWITCHES.values())}
    switches.update({LITGPT_SWITCHES[name]: True for name in lora["hf_targets"]})
    lit.setup(
        Path(spec["litgpt_dir"]),
        out_dir=Path(spec["scratch"]) / "litgpt-out",
        precision="32-true",
        devices=1,
        lora_r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=0.0,
        **switches,
        data=JSON(
            json_path=Path(spec["litgpt_records"]),
            mask_prompt=True,
            val_split_fraction=0.05,
            prompt_style=Default(),
            num_workers=0,
            seed=spec["seed"],
        ),
        train=TrainArgs(
            save_interval=None,
            log_interval=spec["steps"],
            global_batch_size=spec["micro_batch"],
            micro_batch_size=spec["micro_batch"],
            lr_warmup_steps=1,
            epochs=1000,
            max_steps=spec["steps"],
            max_seq_length=spec["seq_len"],
            min_lr=spec["lr"],
        ),
        eval=EvalArgs(interval=10**9, max_new_tokens=1, max_iters=1, initial_validation=False, final_validation=False),
        optimizer={
            "class_path": "torch.optim.AdamW",
            "init_args": {"lr": spec["lr"], "weight_decay": spec["weight_decay"], "betas": spec["betas"]},
        },
        logger_name="csv",
        seed=spec["seed"],
    )
    log.write(out)


def main() -> int:
    if sys.argv[1] == "convert":
        convert(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        run(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
