"""The wheel is the product: built from this checkout, installed into a brand-new virtual environment (no checkout on
any path), and every documented command run from an empty directory by its console script: the demo config for a
few steps with a checkpoint, a tiny fit in tp2, the planner, dedup, decontamination, tokenizer training,
preprocessing, evaluation (with the bias study's shipped word lists), generation, and export's help."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(argv: list[str], cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"{' '.join(map(str, argv))} exited {out.returncode}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(bin folder, environment) of a new venv holding the wheel with its [deepspeed] extra."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # only what a wheel is built from: a stray file of the checkout cannot leak in
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    dist = tmp / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, source],
        tmp,
        dict(os.environ),
    )
    (wheel,) = dist.glob("mtnlg_lightning-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    bin_dir = env_dir / "bin"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": os.environ.get("HOME", str(tmp)),  # pip's cache of wheels
        "MTNLG_CACHE": str(tmp / "cache"),  # the demo corpus is built anew
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONNOUSERSITE": "1",
    }
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"  # the CPU build on this machine, a CUDA build elsewhere
    _run([bin_dir / "python", "-m", "pip", "install", "-q", torch_pin, f"{wheel}[deepspeed]"], tmp, env, timeout=1500)
    return bin_dir, env


def test_the_installed_wheel_runs_every_documented_command_from_an_empty_directory(installed, tmp_path):
    bin_dir, env = installed
    work = tmp_path / "empty"
    work.mkdir()

    def run(tool: str, *args, timeout: int = 600) -> str:
        return _run([bin_dir / tool, *map(str, args)], work, env, timeout).stdout

    where = _run([bin_dir / "python", "-c", "import mtnlg_lightning; print(mtnlg_lightning.__file__)"], work, env)
    assert where.stdout.strip().startswith(str(bin_dir.parent)), where.stdout  # the wheel, not this checkout

    # the demo by its shipped name, a checkpoint after 6 steps
    run("mtnlg", "fit", "--config", "demo", "--trainer.max_steps", "6", "--trainer.val_check_interval", "3",
        "--trainer.limit_val_batches", "1")  # fmt: skip
    checkpoint = work / "runs/demo/checkpoints/last.ckpt"
    assert checkpoint.exists()

    # a tiny fit in tensor parallelism over 2 processes, strategy by its shipped name
    run("mtnlg", "fit", "--config", "tiny", "--trainer.strategy", "strategy/tp2", "--trainer.devices", "2",
        "--trainer.max_steps", "2")  # fmt: skip

    plan = json.loads(run("mtnlg-plan", "--model", "mtnlg-530b", "--tp", "8", "--pp", "35", "--dp", "16", "--json"))
    assert plan["params_per_gpu"] > 0

    # curation and data preparation, each tool by its console script
    run("mtnlg-make-near-dup-corpus", "--docs", "200", "--doc-chars", "800", "--output", "corpus.jsonl")
    run("mtnlg-dedup", "corpus.jsonl", "--output-dir", "dedup", "--quiet")
    (work / "tasks.jsonl").write_text(json.dumps({"text": "a task sentence that never occurs in the corpus"}) + "\n")
    run("mtnlg-decontaminate", "--tasks", "tasks.jsonl", "--input", "dedup/corpus.jsonl", "--output-dir", "clean",
        "--quiet")  # fmt: skip
    assert (work / "clean/corpus.jsonl").stat().st_size > 0
    run("mtnlg-train-tokenizer", "--input", "clean/corpus.jsonl", "--vocab-size", "512", "--output", "tokenizer")
    run("mtnlg-preprocess", "--input", "clean/corpus.jsonl", "--tokenizer", "tokenizer", "--output-prefix",
        "data/corpus", "--no-progress")  # fmt: skip
    assert (work / "data/corpus.bin").stat().st_size > 0 and (work / "data/corpus.idx").exists()

    # the demo model evaluated and sampled
    run("mtnlg-make-cloze-set", "--output", "cloze.jsonl", "--count", "8")
    run("mtnlg-eval", "--checkpoint", checkpoint, "--task", "lambada", "--data", "cloze.jsonl", "--output",
        "eval.json", "--no-progress")  # fmt: skip
    assert json.loads((work / "eval.json").read_text())["results"]["lambada"]["0"]["examples"] == 8
    text = run("mtnlg-generate", "--checkpoint", checkpoint, "--prompt", "The module", "--max-new-tokens", "5",
               "--temperature", "0")  # fmt: skip
    assert text.startswith("The module")
    assert "--overwrite" in run("mtnlg-export-hf", "--help")

    # the bias study's word lists and the paper's suite ship inside the package
    run("mtnlg-eval", "--checkpoint", checkpoint, "--task", "gender-occupation", "--batch-size", "64", "--output",
        "bias.json", "--no-progress")  # fmt: skip
    assert json.loads((work / "bias.json").read_text())["results"]["gender-occupation"]["summary"]["occupations"] > 300
    suites = run("python", "-c", "from mtnlg_lightning.evaluation.suite import shipped; print(shipped())")
    assert suites.strip() == "['mtnlg']"
