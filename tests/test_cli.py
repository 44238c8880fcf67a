"""`mtnlg` through LightningCLI, as a user runs it."""

import csv

import pytest
from conftest import ROOT, run_cli


def read_metrics(save_dir):
    (path,) = list(save_dir.rglob("metrics.csv"))
    return list(csv.DictReader(path.open()))


@pytest.mark.slow
def test_fit_tiny_logs_train_loss_every_step_to_csv_and_learns(tmp_path, demo_data):
    out = run_cli(
        "fit",
        "--config",
        "configs/tiny.yaml",
        "--trainer.max_steps",
        "8",
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path) if r.get("train_loss")]
    assert [int(r["step"]) for r in rows] == list(range(8))
    losses = [float(r["train_loss"]) for r in rows]
    assert losses[-1] < losses[0]
    for key in ("lr", "grad_norm", "consumed_samples", "consumed_tokens", "tokens_per_sec", "tflops_per_device"):
        assert rows[-1][key], key
    assert all(float(r["padding_share"]) == 0.0 for r in rows)  # windows of the token stream: every position a token
    assert all(float(r["peak_memory_mib"]) > 50 for r in rows)  # MiB of a live process, every step
    assert float(rows[-1]["consumed_samples"]) == 64 and float(rows[-1]["consumed_tokens"]) == 64 * 64
    assert "train_loss" in out.stdout and "(first step) ->" in out.stdout


@pytest.mark.slow
def test_fit_help_and_print_config_are_standard_lightning_cli():
    out = run_cli("fit", "--help")
    assert out.returncode == 0 and "--model.preset" in out.stdout and "--data.help" in out.stdout
    assert "mtnlg_lightning.data.GPTDataModule" in out.stdout and "FineTuneDataModule" in out.stdout
    out = run_cli("fit", "--data.help", "GPTDataModule")
    assert out.returncode == 0 and "--data.datasets" in out.stdout and "--data.builtin_corpus" in out.stdout
    out = run_cli("fit", "--data.help", "FineTuneDataModule")
    assert out.returncode == 0 and "--data.train" in out.stdout and "--data.chat_template" in out.stdout
    out = run_cli("fit", "--print_config", "--config", "configs/demo.yaml")
    assert out.returncode == 0, out.stderr
    assert "preset: demo" in out.stdout and "builtin_corpus: python-docs" in out.stdout


@pytest.mark.slow
def test_unknown_preset_is_one_line_without_traceback():
    out = run_cli("fit", "--config", "configs/tiny.yaml", "--model.preset", "gpt5")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("mtnlg: error: unknown model preset 'gpt5'")


@pytest.mark.slow
def test_seq_len_above_position_table_is_one_line(tmp_path):
    out = run_cli("fit", "--config", "configs/tiny.yaml", "--model.model_overrides", "{seq_len: 128}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "seq_len 128 is above the position table size 64" in out.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_dotted_model_override_is_read_in_its_fields_type(tmp_path):
    """`--model.model_overrides.seq_len 128` reaches the model as the string "128" (the parser cannot know a dict's
    value types); the field's type reads it: the number 128, which the position table refuses as in the dict form."""
    out = run_cli("fit", "--config", "configs/tiny.yaml", "--model.model_overrides.seq_len", "128")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "seq_len 128 is above the position table size 64" in out.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_missing_dataset_files_are_one_line(tmp_path):
    out = run_cli(
        "fit", "--config", "configs/tiny.yaml", "--data.builtin_corpus", "null", "--data.datasets", f"[{tmp_path}/nope]"
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"missing dataset file {tmp_path}/nope.idx" in out.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_demo_config_saves_a_checkpoint_and_an_offline_wandb_run(tmp_path, demo_data):
    out = run_cli(
        "fit",
        "--config",
        str(ROOT / "configs" / "demo.yaml"),
        "--trainer.max_steps",
        "6",
        "--trainer.val_check_interval",
        "3",
        "--trainer.limit_val_batches",
        "1",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "runs/demo/checkpoints/last.ckpt").exists()
    (run,) = list((tmp_path / "runs/demo/wandb").glob("offline-run-*"))
    assert list(run.glob("run-*.wandb"))


SHIPPED_CHECK = r"""
import sys
from pathlib import Path
from mtnlg_lightning.train.cli import main

root = Path(sys.argv[1])
tiny = ["fit", "--print_config", "--config", str(root / "configs/tiny.yaml")]
runs = [["fit", "--print_config", "--config", str(c)] for c in sorted((root / "configs").glob("*.yaml"))]
runs += [[*tiny, "--config", str(root / "configs/data/mtnlg_blend.yaml")]]
runs += [[*tiny, "--trainer.strategy", str(s)] for s in sorted((root / "configs/strategy").glob("*.yaml"))]
runs += [[*tiny, "--trainer.callbacks+=" + str(c)] for c in sorted((root / "callbacks").glob("*.yaml"))]
runs += [[*tiny, "--trainer.strategy", sys.argv[2]]]  # the strategy's import path before round 4
for argv in runs:
    try:
        main(argv)
    except SystemExit as end:
        if end.code:
            print(f"FAILED {argv[-1]} (exit {end.code})")
"""


@pytest.mark.slow
def test_every_shipped_config_loads_and_the_old_strategy_path_still_works(tmp_path):
    old = tmp_path / "old_path.yaml"
    old.write_text("class_path: mtnlg_lightning.strategy.MegatronDeepSpeedStrategy\ninit_args: {tensor_parallel: 2}\n")
    script = tmp_path / "check.py"
    script.write_text(SHIPPED_CHECK)
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(script), str(ROOT), str(old)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert out.returncode == 0 and "FAILED" not in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("class_path: mtnlg_lightning.strategy.MegatronDeepSpeedStrategy") == 1
    configs = len(list(ROOT.glob("configs/*.yaml"))) + 1 + len(list(ROOT.glob("configs/strategy/*.yaml")))
    assert out.stdout.count("seed_everything:") == configs + len(list(ROOT.glob("callbacks/*.yaml"))) + 1
