"""Fine-tuning as a user types it: `mtnlg fit --config lora` (and `--config sft`) from a Hugging Face Llama
directory on chat records, then the exports of the checkpoint, and the one-line errors of what is missing."""

from __future__ import annotations

import json
import re
import warnings

import pytest
from conftest import run_cli

from mtnlg_lightning.demo.synthetic.instructions import write_instructions

# A few seconds of a tiny Llama: 12 LoRA steps of 4 packed 256-token rows.
QUICK = [
    "--model.model_overrides",
    "{seq_len: 256}",
    "--model.micro_batch_size",
    "2",
    "--model.global_batch_size",
    "4",
    "--model.lr",
    "1.0e-2",
    "--model.warmup_tokens",
    "2048",
    "--model.decay_tokens",
    "12288",
    "--trainer.max_steps",
    "12",
    "--trainer.val_check_interval",
    "6",
    "--data.chat_template",
    "chatml",
]
SUMMARY = re.compile(r"train_loss ([\d.]+) \(first step\) -> ([\d.]+) \(step (\d+)\)")
# What Lightning, torch and wandb printed at every fine-tuning run until `train/quiet.py` (issue 58), none of it
# meaningful here. The messages' own words, not quiet.py's patterns: a message reworded by a release shows here.
NOISE = (
    "has `__len__` defined",
    "across ranks is zero",
    "not supported by the model summary",
    "LeafSpec",
    "litlogger",
    "litmodels",
    "Total FLOPs",
    "Total Flops",
    "git root",
)


def noise_in(out) -> list[str]:
    return [words for words in NOISE if words in out.stdout + out.stderr]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    from hf_models import random_family_dir

    root = tmp_path_factory.mktemp("finetune_cli")
    base = random_family_dir(root, "llama")
    write_instructions(root / "chat.jsonl", count=400, seed=0)
    write_instructions(root / "valid.jsonl", count=64, seed=1)
    return {"root": root, "base": base}


def fit(config: str, data: dict, run: str, *extra: str, valid: bool = True, logger: bool = False):
    """`logger`: the config's own (wandb, offline), else none; `valid`: held-out records, else no validation."""
    root = data["root"]
    checkpoints = root / run / "checkpoints"
    out = run_cli(
        "fit",
        "--config",
        config,
        "--model.init_from",
        str(data["base"]),
        "--data.train",
        str(root / "chat.jsonl"),
        *(["--data.valid", str(root / "valid.jsonl")] if valid else []),
        *QUICK,
        *([] if logger else ["--trainer.logger", "false"]),
        f"--trainer.default_root_dir={root / run}",
        f"--trainer.callbacks.dirpath={checkpoints}",
        "--trainer.callbacks.every_n_train_steps=6",
        *extra,
        cwd=root,
    )
    return out, checkpoints


@pytest.fixture(scope="module")
def lora_cli_run(chat_data):
    out, checkpoints = fit("lora", chat_data, "lora", "--model.lora", "{rank: 16, alpha: 32}", logger=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return {"out": out, "checkpoints": checkpoints, **chat_data}


@pytest.mark.slow
def test_the_shipped_lora_config_fine_tunes_a_hugging_face_directory_on_chat_records(lora_cli_run):
    first, last, step = SUMMARY.search(lora_cli_run["out"].stdout).groups()
    assert int(step) == 12 and float(last) < float(first) - 0.5  # the assistant's answers are being learnt
    manifest = json.loads((lora_cli_run["checkpoints"] / "last.ckpt" / "manifest.json").read_text())
    weights = [name for name in manifest["tensors"] if name.startswith("model/")]
    assert weights and all(name.endswith((".lora_a", ".lora_b")) for name in weights)
    assert manifest["lora"]["rank"] == 16 and manifest["lora"]["alpha"] == 32


@pytest.mark.slow
def test_a_fine_tuning_run_prints_none_of_the_frameworks_noise(lora_cli_run):
    """The LoRA run (validation, the config's wandb logger) here, a run without validation records in the SFT test."""
    assert noise_in(lora_cli_run["out"]) == [], lora_cli_run["out"].stderr[-3000:]


def test_only_the_known_warnings_are_silenced():
    """No validation records (an empty list of loaders) is silenced; a split too small for one global batch (an empty
    DataLoader) is still said."""
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.utilities.data import has_len_all_ranks
    from torch.utils.data import DataLoader

    from mtnlg_lightning.train.quiet import quiet_known_noise

    strategy = SingleDeviceStrategy("cpu")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_known_noise()
        has_len_all_ranks([], strategy)
        has_len_all_ranks(DataLoader([]), strategy)
    assert [str(warning.message).split(".")[0] for warning in seen] == [
        "Total length of `DataLoader` across ranks is zero"
    ]


@pytest.mark.slow
def test_the_adapter_and_the_merged_model_export_from_the_cli_checkpoint(lora_cli_run, tmp_path):
    from conftest import tool_main

    export = tool_main("export_hf")
    checkpoint = lora_cli_run["checkpoints"] / "last.ckpt"
    assert export([str(checkpoint), str(tmp_path / "adapter"), "--adapter"]) == 0
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32
    assert adapter["base_model_name_or_path"] == str(lora_cli_run["base"].resolve())
    assert export([str(checkpoint), str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").is_file() and (tmp_path / "merged" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_the_shipped_sft_config_trains_every_weight(chat_data):
    out, checkpoints = fit("sft", chat_data, "sft", "--model.lr", "3.0e-3", valid=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert noise_in(out) == [], out.stderr[-3000:]  # no validation records: nothing said about it
    first, last, _ = SUMMARY.search(out.stdout).groups()
    assert float(last) < float(first) - 0.5
    manifest = json.loads((checkpoints / "last.ckpt" / "manifest.json").read_text())
    weights = [name for name in manifest["tensors"] if name.startswith("model/")]
    assert "lora" not in manifest and not any("lora" in name for name in weights)
    assert any(name.endswith("attention.qkv.weight") or "q_proj" in name or ".q." in name for name in weights), weights


@pytest.mark.slow
@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--config", "lora", "--model.init_from", "BASE"], r"^mtnlg: error: --data\.train required by "),
        (["--config", "lora", "--data.train", "CHAT"], r"^mtnlg: error: model\.lora needs model\.init_from"),
        (["--config", "sft", "--data.train", "CHAT"], r"^mtnlg: error: fine-tuning needs model\.init_from"),
        (
            [
                "--config",
                "lora",
                "--model.init_from",
                "BASE",
                "--data.train",
                "CHAT",
                *QUICK[:2],
                "--data.chat_template",
                "{% for m in messages %}{{ m.nope.deeper }}{% endfor %}",
            ],
            r"^mtnlg: error: .*chat\.jsonl:1: the chat template fails on this record",
        ),
        (
            ["--config", "lora", "--model.init_from", "BASE", "--data.train", "BAD", *QUICK[:2], *QUICK[-2:]],
            r"^mtnlg: error: .*bad\.jsonl:1: a record in no known form \(fields: bar, foo\)",
        ),
    ],
    ids=["no-train", "lora-without-base", "sft-without-base", "template-fails", "unknown-record"],
)
def test_what_fine_tuning_lacks_is_one_line(chat_data, arguments, message):
    bad = chat_data["root"] / "bad.jsonl"
    bad.write_text(json.dumps({"foo": 1, "bar": 2}) + "\n")
    names = {"BASE": str(chat_data["base"]), "CHAT": str(chat_data["root"] / "chat.jsonl"), "BAD": str(bad)}
    out = run_cli("fit", *[names.get(a, a) for a in arguments], "--trainer.logger", "false", cwd=chat_data["root"])
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("mtnlg: error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), out.stderr[-2000:]
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_the_fine_tuned_checkpoint_answers_a_chat_prompt(lora_cli_run, capsys):
    from mtnlg_lightning.inference.generate_cli import main as generate

    checkpoint = lora_cli_run["checkpoints"] / "last.ckpt"
    arguments = ["--checkpoint", str(checkpoint), "--chat", "--prompt", "What is 3 + 5?", "--temperature", "0"]
    assert generate([*arguments, "--max-new-tokens", "24"]) == 0
    answer = capsys.readouterr().out.strip()
    assert "<|im_start|>" not in answer and "What is 3 + 5?" not in answer  # the answer alone, in its own turn
