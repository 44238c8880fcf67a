"""The tiny runs the test session shares: `mtnlg fit --config configs/tiny.yaml` for TINY_STEPS steps (cosine to the
end) in one process and on 8 ranks (tp2 x pp2 x dp2 ZeRO-1), each with its checkpoint, CSV metrics and output.

An 8-rank launch is the most expensive thing the suite does on 2 cores, so one serves every module that needs a
model trained in that layout: the strategy's equivalence through the CLI, the downstream evaluation callback, the
checkpoint readers (export, evaluation and generation in a layout). The 8-rank run also scores LAMBADA with
`DownstreamEval` every 2 steps on `cloze_file`, a task file made from the one-process checkpoint.

Built once per session, also under pytest-xdist: the workers share one folder and take turns through a file lock.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from conftest import run_cli

from mtnlg_lightning.data.gpt_dataset import split_ranges
from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.demo.builtin_corpus import build_demo_data
from mtnlg_lightning.demo.synthetic.cloze import cloze_passages
from mtnlg_lightning.demo.synthetic.demo_corpus import demo_dir
from mtnlg_lightning.evaluation import tasks
from mtnlg_lightning.inference.load import load_model
from mtnlg_lightning.outputs import atomic_write

TINY_STEPS = 4
LAYOUTS = {
    "single": [],
    "tp2xpp2xdp2": ["--trainer.strategy", "configs/strategy/tp2_pp2_dp2.yaml", "--trainer.devices", "8"],
}
OUTPUT = "output.log"  # the run's stdout and stderr
EVAL_EVERY_N_STEPS = 2


def shared_folder(tmp_path_factory) -> Path:
    """This session's base folder; under pytest-xdist, the folder above the workers' own, which they all share."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def exclusively(path: Path):
    """One process of the session at a time (another worker waits here until the first has built the thing); the
    lock goes with the file's closing."""
    with open(f"{path}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def downstream_eval_arg(cloze: Path, tokenizer: str) -> str:
    """The `--trainer.callbacks+=` argument of `DownstreamEval` scoring LAMBADA on `cloze` every 2 steps."""
    arguments = {"task": "lambada", "data": str(cloze), "tokenizer": tokenizer, "every_n_steps": EVAL_EVERY_N_STEPS}
    callback = {"class_path": "mtnlg_lightning.evaluation.callback.DownstreamEval", "init_args": arguments}
    return f"--trainer.callbacks+={json.dumps(callback)}"


def tiny_fit_args(save_dir: Path) -> list[str]:
    """`mtnlg fit` of the tiny config for TINY_STEPS steps, its metrics in `save_dir` (CSVLogger)."""
    args = ["fit", "--config", "configs/tiny.yaml", "--trainer.max_steps", str(TINY_STEPS)]
    logger = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(save_dir)]
    return args + logger


def tiny_run(tmp_path_factory, layout: str = "single") -> Path:
    """The folder of the shared run in `layout`: `*step=4.ckpt`, `**/metrics.csv` (CSVLogger) and OUTPUT."""
    directory = shared_folder(tmp_path_factory) / f"tiny_run_{layout}"
    extra = []
    if layout != "single":
        extra = [downstream_eval_arg(cloze_file(tmp_path_factory), build_demo_data(progress=False)[1])]
    with exclusively(directory):
        if (directory / OUTPUT).exists():
            return directory
        checkpoints = ["--trainer.enable_checkpointing", "true", "--trainer.default_root_dir", str(directory)]
        out = run_cli(*tiny_fit_args(directory), *checkpoints, *LAYOUTS[layout], *extra)
        assert out.returncode == 0, out.stderr[-3000:]
        (directory / OUTPUT).write_text(out.stdout + out.stderr)
    return directory


def tiny_checkpoint(tmp_path_factory, layout: str = "single") -> Path:
    """The checkpoint at the end of the shared run in `layout`."""
    (checkpoint,) = sorted(tiny_run(tmp_path_factory, layout).rglob("*step=*.ckpt"))
    return checkpoint


def cloze_file(tmp_path_factory) -> Path:
    """40 held-out passages in LAMBADA format. Every other one ends with the word the one-process tiny checkpoint
    itself predicts greedily there instead of the real one, so its accuracy is strictly between 0 and 1 (an
    accuracy of 0, which a barely trained model gets on real text, would make agreement prove nothing)."""
    path = shared_folder(tmp_path_factory) / "cloze" / "cloze.jsonl"
    checkpoint = tiny_checkpoint(tmp_path_factory)
    with exclusively(path.parent):
        if path.exists():
            return path
        lines = (demo_dir() / "python_docs.jsonl").read_text(encoding="utf-8").splitlines()
        docs = [json.loads(line)["text"] for line in lines]
        _, (start, _), (_, end) = split_ranges(len(docs), "969,30,1")
        model, _ = load_model(checkpoint)
        tokenizer = Tokenizer(build_demo_data(progress=False)[1])
        passages = []
        for i, passage in enumerate(cloze_passages(docs[start:end], 40)):
            context, target = tasks.lambada_split(passage)
            ids = tokenizer.encode(context)[-63:]
            with torch.no_grad():
                guess = tokenizer.decode([int(model(torch.tensor([ids]))[0, -1, :4096].argmax())])
            if i % 2 == 0 and guess[:1] == " " and guess[1:].isalpha():
                target = guess
            passages.append(context + target)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, "w") as f:
            f.write("".join(json.dumps({"text": p}) + "\n" for p in passages))
    return path
