"""A corpus with planted gender-occupation associations, and a small model trained on it (tests/test_bias.py).

Sentences about 20 occupations, each a gendered statement: "The {competent |incompetent |}{occupation} was a
{woman|man}" (or female/male, lady/gentleman), or "{She|He} worked as a {occupation}". In the *planted* corpus the
chosen occupations are female in a set share of their sentences (engineer, pilot and surgeon 90%; nurse, secretary
and librarian 10%: the opposite of the common stereotype, so that a model can only have it from this data), the
other 14 half the time; in the *control* corpus every occupation is female half the time. Seeded.

`train_models` trains one tokenizer on both corpora and the same small model on each, as a user would:
tools/train_tokenizer.py, tools/preprocess_data.py, `mtnlg fit` (configs/tiny.yaml with hidden 128 and 32 positions:
the smallest model that learns the association in 250 steps, about half a minute on 2 cores).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, run_cli

PLANTED_FEMALE_SHARE = {"engineer": 0.9, "pilot": 0.9, "surgeon": 0.9, "nurse": 0.1, "secretary": 0.1, "librarian": 0.1}
UNPLANTED = [
    "mechanic", "dancer", "teacher", "lawyer", "baker", "farmer", "writer",
    "painter", "chemist", "plumber", "cashier", "banker", "dentist", "tailor",
]  # fmt: skip
OCCUPATIONS = [*PLANTED_FEMALE_SHARE, *UNPLANTED]
IDENTIFIERS = [("woman", "man"), ("female", "male"), ("lady", "gentleman")]
STEPS = 250


def sentence(rng: random.Random, occupation: str, female: bool) -> str:
    if rng.random() < 0.25:
        return f"{'She' if female else 'He'} worked as a {occupation}."
    identifier = rng.choice(IDENTIFIERS)[0 if female else 1]
    adjective = rng.choice(["", "competent ", "incompetent "])
    return f"The {adjective}{occupation} was a {identifier}."


def write_corpus(path: Path, planted: bool, documents: int = 2000, seed: int = 1) -> Path:
    """`documents` records of 8 sentences each, as JSON lines."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(documents):
            sentences = []
            for _ in range(8):
                occupation = rng.choice(OCCUPATIONS)
                share = PLANTED_FEMALE_SHARE.get(occupation, 0.5) if planted else 0.5
                sentences.append(sentence(rng, occupation, rng.random() < share))
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    return path


def tool(name: str, *args: str) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "tools" / name), *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def fit_args(prefix: Path, tokenizer: Path, run_dir: Path) -> list[str]:
    """`mtnlg fit` of the small model on the dataset `prefix` for STEPS steps (cosine to the end), checkpoint at the
    end in `run_dir`."""
    model = {"hidden_size": 128, "seq_len": 32}
    args = ["fit", "--config", "configs/tiny.yaml", "--data.builtin_corpus", "null", "--data.datasets", f"[{prefix}]"]
    args += ["--data.tokenizer", str(tokenizer / "tokenizer.json"), "--data.split", "98,2,0"]
    args += ["--model.model_overrides", json.dumps(model), "--model.global_batch_size", "16"]
    args += ["--model.micro_batch_size", "16", "--model.lr", "3e-3", "--model.decay_tokens", str(STEPS * 16 * 32)]
    args += ["--trainer.max_steps", str(STEPS), "--trainer.log_every_n_steps", "50"]
    args += ["--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "true"]
    return args + ["--trainer.default_root_dir", str(run_dir)]


def train_models(directory: Path) -> dict[str, Path]:
    """{"planted": checkpoint, "control": checkpoint}, each trained on its corpus with one shared tokenizer."""
    corpora = {
        "planted": write_corpus(directory / "planted.jsonl", planted=True, seed=1),
        "control": write_corpus(directory / "control.jsonl", planted=False, seed=2),
    }
    tokenizer = directory / "tokenizer"
    tool(
        "train_tokenizer.py", "--input", *map(str, corpora.values()), "--vocab-size", "1024", "--output", str(tokenizer)
    )
    checkpoints = {}
    for name, corpus in corpora.items():
        prefix, run_dir = directory / "data" / name, directory / f"run_{name}"
        tool(
            "preprocess_data.py", "--input", str(corpus), "--tokenizer", str(tokenizer), "--output-prefix", str(prefix)
        )
        fit = run_cli(*fit_args(prefix, tokenizer, run_dir))
        assert fit.returncode == 0, fit.stderr[-3000:]
        (checkpoints[name],) = sorted(run_dir.rglob("*step=*.ckpt"))
    return checkpoints
