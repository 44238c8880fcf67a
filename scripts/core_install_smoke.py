#!/usr/bin/env python
"""The core commands in an environment that has only the core install (no extras), as a new user has.

Run by `scripts/check_core_install.sh` (which builds that environment) with that environment's Python:
a short demo that saves checkpoints and resumes from them, consolidation, generation and evaluation from the
checkpoint, the curation tools, tokenizer training and preprocessing, every console script's and tool's `--help`,
and every optional command's one-line "install the extra" message (exit 2, before any work). Exits 1 on the
first failure, naming the command and showing its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import distribution
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the console scripts of this environment


def run(args: list[str], cwd: Path, expect: int = 0, stdin: str | None = None) -> subprocess.CompletedProcess:
    started = time.perf_counter()
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, input=stdin, timeout=900)
    shown = " ".join(Path(a).name if a.startswith(str(ROOT)) or a == sys.executable else a for a in args)
    if done.returncode != expect:
        print(f"core install: FAILED (exit {done.returncode}, expected {expect}): {shown}", file=sys.stderr)
        print(done.stdout[-4000:], done.stderr[-6000:], sep="\n", file=sys.stderr)
        sys.exit(1)
    print(f"  ok {time.perf_counter() - started:5.1f} s  {shown[:150]}", flush=True)
    return done


def check_extra_message(args: list[str], cwd: Path, extra: str) -> None:
    """Exit 2 with exactly one line on stderr that names the extra to install."""
    done = run(args, cwd, expect=2)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    hint = f"pip install 'mtnlg-lightning[{extra}]'"
    if len(lines) != 1 or hint not in lines[0]:
        print(f"core install: FAILED: expected one line naming {hint}, got:\n{done.stderr}", file=sys.stderr)
        sys.exit(1)


def write_corpus(path: Path, docs: int) -> None:
    words = "the model reads a file and writes every record it was given to a new place on the disk".split()
    with path.open("w", encoding="utf-8") as handle:
        for i in range(docs):
            text = " ".join(words[(i + j) % len(words)] for j in range(60 + i % 7)) + f" document {i}."
            handle.write(json.dumps({"id": i, "text": text}) + "\n")


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="mtnlg-core-"))
    os.environ.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1", MTNLG_CACHE=str(work / "cache"))
    py, mtnlg = sys.executable, str(BIN / "mtnlg")
    print(f"core install: {py} (work dir {work})")

    # training crosses a checkpoint save, then a resume from it (the demo's config, 4 + 2 steps)
    (work / "short.yaml").write_text(
        "trainer:\n  max_steps: 4\n  callbacks:\n"
        "    - class_path: mtnlg_lightning.checkpoint.ModelCheckpoint\n"
        "      init_args: {dirpath: runs/demo/checkpoints, filename: '{step}', every_n_train_steps: 2,"
        " save_last: link, save_top_k: -1}\n"
        "    - class_path: mtnlg_lightning.callbacks.LossSpikeDetection\n"
        "    - class_path: mtnlg_lightning.callbacks.ActivationCheckpointing\n"
        "      init_args: {mode: selective}\n"
    )
    demo = [mtnlg, "fit", "--config", str(ROOT / "configs/demo.yaml"), "--config", "short.yaml"]
    run(demo, work)
    run([*demo, "--trainer.max_steps", "6", "--ckpt_path", "last"], work)
    checkpoints = work / "runs/demo/checkpoints"
    for step in (2, 4, 6):
        if not (checkpoints / f"step={step}.ckpt" / "manifest.json").is_file():
            print(f"core install: FAILED: no complete checkpoint step={step}.ckpt after the resume", file=sys.stderr)
            return 1
    last = str(checkpoints / "last.ckpt")

    # the checkpoint's other readers
    run([py, str(ROOT / "tools/consolidate_checkpoint.py"), last, "model.safetensors"], work)
    run([str(BIN / "mtnlg-generate"), "--checkpoint", last, "--prompt", "The file", "--max-new-tokens", "8"], work)
    (work / "text.jsonl").write_text(json.dumps({"text": "Return the name of the file that was opened."}) + "\n")
    run([str(BIN / "mtnlg-eval"), "--checkpoint", last, "--task", "perplexity", "--data", "text.jsonl"], work)

    # curation, tokenizer training and preprocessing
    write_corpus(work / "corpus.jsonl", 40)
    run([str(BIN / "mtnlg-dedup"), "corpus.jsonl", "-o", "dedup", "--workers", "1", "-q"], work)
    (work / "task.jsonl").write_text(json.dumps({"text": " ".join(["every record it was given"] * 3)}) + "\n")
    decon = [str(BIN / "mtnlg-decontaminate"), "--tasks", "task.jsonl", "--input", "corpus.jsonl"]
    run([*decon, "--output", "clean.jsonl", "--workers", "1"], work)
    tools = ROOT / "tools"
    run(
        [py, str(tools / "train_tokenizer.py"), "--input", "corpus.jsonl", "--vocab-size", "300", "--output", "tok"],
        work,
    )
    prep = [py, str(tools / "preprocess_data.py"), "--input", "corpus.jsonl", "--tokenizer", "tok"]
    run([*prep, "--output-prefix", "data/corpus", "--no-progress"], work)
    quality = str(BIN / "mtnlg-quality")  # the heuristic rules need only the core install
    run([quality, "annotate", "corpus.jsonl", "-o", "annotated", "-q"], work)
    run([quality, "filter", "annotated/corpus.jsonl", "-o", "kept", "--heuristics", "-q"], work)

    # every entry point explains itself
    for entry in distribution("mtnlg-lightning").entry_points:
        if entry.group == "console_scripts":
            run([str(BIN / entry.name), "--help"], work)
    for tool in sorted(tools.glob("*.py")):
        if not tool.name.startswith("_"):
            run([py, str(tool), "--help"], work)

    # the optional commands: one line naming their extra, before any work starts
    check_extra_message([str(BIN / "mtnlg-export-hf"), last, "export"], work, "hf")
    check_extra_message(
        [str(BIN / "mtnlg-eval"), "--checkpoint", last, "--harness-tasks", "lambada_openai"], work, "eval"
    )
    suite = ["--suite", "mtnlg", "--task-data", "HANS=text.jsonl"]
    check_extra_message([str(BIN / "mtnlg-eval"), "--checkpoint", last, *suite], work, "eval")
    check_extra_message([str(BIN / "mtnlg-eval"), "--checkpoint", last, "--task", "cooccurrence"], work, "bias")
    check_extra_message([str(BIN / "mtnlg-dedup"), "corpus.jsonl", "-o", "ray_out", "--engine", "ray"], work, "ray")
    check_extra_message([*decon, "--output", "ray.jsonl", "--engine", "ray"], work, "ray")
    zero1 = ["--trainer.strategy", str(ROOT / "configs/strategy/zero1.yaml")]
    check_extra_message([mtnlg, "fit", "--config", str(ROOT / "configs/tiny.yaml"), *zero1], work, "deepspeed")
    check_extra_message([py, str(tools / "pipeline.py"), "pipeline_out", "--smoke"], work, "hf")
    check_extra_message([str(BIN / "mtnlg-extract"), "crawl.warc.gz", "-o", "crawl_out"], work, "crawl")
    train = [quality, "train", "--positive", "corpus.jsonl", "--negative", "corpus.jsonl", "--model", "m.npz"]
    check_extra_message(train, work, "crawl")
    # object storage: a URL needs fsspec and s3fs (local paths above needed neither)
    check_extra_message([str(BIN / "mtnlg-dedup"), "s3://corpora/web.jsonl", "-o", "s3_out"], work, "cloud")
    check_extra_message([*prep, "--output-prefix", "s3://corpora/data/corpus"], work, "cloud")
    print(f"core install: every core command ran and every optional command named its extra ({work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
