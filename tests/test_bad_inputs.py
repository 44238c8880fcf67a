"""The bad-input table of every CLI: missing, empty, directory-instead-of-file, file-instead-of-directory,
non-UTF-8, numeric flags out of range, unknown or unavailable --device -- each one `PROG: error:` line (argparse's
usage line may precede it) and its exit code, never a traceback. The tools' `main()` run in-process (a subprocess
costs seconds each). Record-content rows of the data tools (malformed JSON, missing or non-string text field, a
huge single line) are tested with their reader (issue 27), not here."""

from __future__ import annotations

import importlib
import io
import json
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# Imported here, outside any test's captured stderr: Lightning binds its log handler to sys.stderr on import.
import mtnlg_lightning.train.cli  # noqa: E402, F401
from testing.checkpoint_fuzzing import make_checkpoint  # noqa: E402


def _main(tool: str):
    """The main of a console script, as [project.scripts] names it."""
    module, function = SCRIPTS[tool].split(":")
    return getattr(importlib.import_module(module), function)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every kind of bad path, plus good ones to pair them with."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("bad")
    (root / "empty.jsonl").write_bytes(b"")
    (root / "adir").mkdir()
    (root / "emptydir").mkdir()
    (root / "plain.txt").write_text("just a file\n")
    (root / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9 cr\xe8me"}\n')
    (root / "good.jsonl").write_text("".join(json.dumps({"text": f"a b c {i}"}) + "\n" for i in range(4)))
    (root / "tasks.jsonl").write_text(json.dumps({"task": "t", "text": "one two three four five six seven eight"}))
    make_checkpoint(root / "ckpt", root / "outside.safetensors")
    words = ["<|endoftext|>", "[UNK]", "a", "b", "c", "caf", "the"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(root / "tokenizer.json"))
    for name, args in (("cp2", "{context_parallel: 2}"), ("cp3", "{context_parallel: 3}")):
        (root / f"{name}.yaml").write_text(
            f"class_path: mtnlg_lightning.strategy.MegatronDeepSpeedStrategy\ninit_args: {args}\n"
        )
    (root / "cp2_math.yaml").write_text(
        "class_path: mtnlg_lightning.strategy.MegatronDeepSpeedStrategy\n"
        "init_args: {context_parallel: 2, context_parallel_kernel: math, zero_stage: 0}\n"
    )
    (root / "nonempty").mkdir()
    (root / "nonempty" / "keep.txt").write_text("mine")
    return root


GEN = ["--checkpoint", "{ckpt}", "--tokenizer", "{tok}", "--device", "cpu"]
EVAL = ["--checkpoint", "{ckpt}", "--tokenizer", "{tok}", "--task", "lambada", "--device", "cpu"]
DECON_OUT = ["--output", "{out}/c.jsonl"]
PRE = ["--tokenizer", "{tok}", "--output-prefix", "{out}/d"]
FIT = ["fit", "--config", "{tiny}", "--trainer.default_root_dir", "{out}"]
# (tool, arguments, stdin, exit code, what the error line says)
ROWS = [
    # mtnlg
    ("mtnlg", ["fit", "--config", "{missing}"], None, 2, "missing.jsonl: no such file, and no shipped config"),
    ("mtnlg", ["fit", "--config", "{adir}"], None, 2, "Path is not a file"),
    ("mtnlg", ["fit", "--config", "{latin1}"], None, 2, "not UTF-8"),
    ("mtnlg", [*FIT, "--trainer.accelerator", "quantum"], None, 2, "unknown trainer.accelerator"),
    ("mtnlg", [*FIT, "--trainer.accelerator", "tpu"], None, 2, "no such device"),
    ("mtnlg", [*FIT, "--trainer.max_steps", "-5"], None, 2, "max_steps"),
    ("mtnlg", [*FIT, "--model.micro_batch_size", "0"], None, 2, "micro_batch_size"),
    ("mtnlg", [*FIT, "--ckpt_path", "{plain}"], None, 2, "not a readable checkpoint"),
    ("mtnlg", [*FIT, "--ckpt_path", "{emptydir}"], None, 2, "no manifest.json"),
    ("mtnlg", [*FIT, "--data.builtin_corpus", "null", "--data.datasets", "[{missing}]"], None, 2, "missing dataset"),
    (
        "mtnlg",
        [*FIT, "--data.builtin_corpus", "nope"],
        None,
        2,
        "unknown builtin_corpus 'nope'; available:",
    ),
    # context parallelism: the world, the sequence's chunks, the ring's kernel
    (
        "mtnlg",
        [*FIT, "--trainer.strategy", "{cp2}"],
        None,
        2,
        "world size 1 is not divisible by tensor_parallel 1 x context_parallel 2 x pipeline_parallel 1 = 2",
    ),
    ("mtnlg", [*FIT, "--trainer.strategy", "{cp3}"], None, 2, "seq_len 64 is not divisible by 2 x context_parallel"),
    ("mtnlg", [*FIT, "--trainer.strategy", "{cp2_math}"], None, 2, "'math' (torch's math path) returns none"),
    # attention kinds per layer: a pattern of the wrong length, a window that changes nothing
    (
        "mtnlg",
        [
            *FIT,
            "--model.model_overrides.layer_types",
            "[sliding_attention]",
            "--model.model_overrides.sliding_window",
            "8",
        ],
        None,
        2,
        "layer_types lists 1 layer kinds for a 2-layer model",
    ),
    (
        "mtnlg",
        [*FIT, *("--model.model_overrides.family", "null", "--model.model_overrides.sliding_window", "64")]
        + ["--model.model_overrides.layer_types", "[sliding_attention, full_attention]"],
        None,
        2,
        "sliding_window 64 is not smaller than seq_len 64: no query would lose a key",
    ),
    # mtnlg-dedup
    ("mtnlg-dedup", ["{missing}", "-o", "{out}"], None, 2, "no such file"),
    ("mtnlg-dedup", ["{empty}", "-o", "{out}"], None, 2, "empty input"),
    ("mtnlg-dedup", ["{adir}", "-o", "{out}"], None, 2, "is a directory"),
    ("mtnlg-dedup", ["{good}", "-o", "{plain}"], None, 2, "is a file, expected a directory"),
    ("mtnlg-dedup", ["{good}", "-o", "{out}", "--threshold", "1.5"], None, 2, "threshold"),
    ("mtnlg-dedup", ["{good}", "-o", "{out}", "--workers", "0"], None, 2, "positive integer"),
    # mtnlg-decontaminate
    ("mtnlg-decontaminate", ["--tasks", "{tasks}", "--input", "{missing}", *DECON_OUT], None, 2, "no such file"),
    ("mtnlg-decontaminate", ["--tasks", "{tasks}", "--input", "{adir}", *DECON_OUT], None, 2, "is a directory"),
    ("mtnlg-decontaminate", ["--tasks", "{empty}", "--input", "{good}", *DECON_OUT], None, 2, "empty"),
    (
        "mtnlg-decontaminate",
        ["--tasks", "{tasks}", "--input", "{good}", "--output", "{adir}"],
        None,
        2,
        "is a directory",
    ),
    ("mtnlg-decontaminate", ["--tasks", "{tasks}", "--input", "{good}", "--output", "{good}"], None, 2, "is the input"),
    (
        "mtnlg-decontaminate",
        ["--tasks", "{tasks}", "--input", "{good}", "--output", "{out}/c", "--max-ngram", "0"],
        None,
        2,
        "positive",
    ),
    # mtnlg-eval
    ("mtnlg-eval", ["--checkpoint", "{missing}", "--task", "lambada", "--data", "{good}"], None, 2, "does not exist"),
    ("mtnlg-eval", ["--checkpoint", "{emptydir}", "--task", "lambada", "--data", "{good}"], None, 2, "no manifest"),
    (
        "mtnlg-eval",
        ["--checkpoint", "{plain}", "--task", "lambada", "--data", "{good}"],
        None,
        2,
        "not a readable checkpoint",
    ),
    ("mtnlg-eval", [*EVAL, "--data", "{missing}"], None, 2, "does not exist"),
    ("mtnlg-eval", [*EVAL, "--data", "{adir}"], None, 2, "is a directory"),
    ("mtnlg-eval", [*EVAL, "--data", "{empty}"], None, 2, "is empty"),
    ("mtnlg-eval", [*EVAL, "--data", "{latin1}"], None, 2, "not UTF-8"),
    ("mtnlg-eval", [*EVAL, "--data", "{good}", "--batch-size", "0"], None, 2, "--batch-size"),
    ("mtnlg-eval", [*EVAL, "--data", "{good}", "--limit", "0"], None, 2, "--limit"),
    ("mtnlg-eval", [*EVAL, "--data", "{good}", "--output", "{good}"], None, 2, "is the input"),
    ("mtnlg-eval", [*EVAL, "--data", "{good}", "--output", "{adir}"], None, 2, "is a directory"),
    ("mtnlg-eval", [*EVAL[:-1], "quantum", "--data", "{good}"], None, 2, "unknown --device"),
    ("mtnlg-eval", [*EVAL[:-1], "cuda:99", "--data", "{good}"], None, 2, "cuda"),
    # mtnlg-generate
    ("mtnlg-generate", [*GEN, "--prompt", "a", "--top-k", "-1"], None, 2, "--top-k"),
    ("mtnlg-generate", [*GEN, "--prompt", "a", "--top-p", "0"], None, 2, "--top-p"),
    ("mtnlg-generate", [*GEN, "--prompt", "a", "--top-p", "1.5"], None, 2, "--top-p"),
    ("mtnlg-generate", [*GEN, "--prompt", "a", "--temperature", "-1"], None, 2, "--temperature"),
    ("mtnlg-generate", [*GEN, "--prompt", "a", "--max-new-tokens", "0"], None, 2, "--max-new-tokens"),
    ("mtnlg-generate", [*GEN, "--prompt", "-"], b"caf\xe9\n", 2, "stdin is not UTF-8"),
    ("mtnlg-generate", [*GEN, "--prompt", "-"], b"\n\n", 2, "no prompt"),
    ("mtnlg-generate", [*GEN[:-1], "bogus", "--prompt", "a"], None, 2, "unknown --device"),
    ("mtnlg-generate", ["--checkpoint", "{missing}", "--prompt", "a", "--device", "cpu"], None, 2, "does not exist"),
    ("mtnlg-generate", ["--checkpoint", "{plain}", "--prompt", "a", "--device", "cpu"], None, 2, "not a readable"),
    # mtnlg-export-hf
    ("mtnlg-export-hf", ["{missing}", "{out}"], None, 2, "does not exist"),
    ("mtnlg-export-hf", ["{emptydir}", "{out}"], None, 2, "no manifest"),
    ("mtnlg-export-hf", ["{ckpt}", "{plain}"], None, 2, "is a file"),
    ("mtnlg-export-hf", ["{ckpt}", "{ckpt}", "--overwrite"], None, 2, "is the input"),
    ("mtnlg-export-hf", ["{ckpt}", "{out}", "--dtype", "fp8"], None, 2, "invalid choice"),
    # tools/preprocess_data.py
    ("mtnlg-preprocess", ["--input", "{missing}", *PRE], None, 2, "does not exist"),
    ("mtnlg-preprocess", ["--input", "{adir}", *PRE], None, 2, "is a directory"),
    ("mtnlg-preprocess", ["--input", "{empty}", *PRE], None, 2, "is empty"),
    (
        "mtnlg-preprocess",
        ["--input", "{good}", "--tokenizer", "{missing}", "--output-prefix", "{out}/d"],
        None,
        2,
        "no tokenizer",
    ),
    ("mtnlg-preprocess", ["--input", "{good}", *PRE, "--workers", "0"], None, 2, "positive"),
    # tools/train_tokenizer.py
    ("mtnlg-train-tokenizer", ["--input", "{missing}", "--output", "{out}/t.json"], None, 2, "does not exist"),
    ("mtnlg-train-tokenizer", ["--input", "{adir}", "--output", "{out}/t.json"], None, 2, "is a directory"),
    ("mtnlg-train-tokenizer", ["--input", "{empty}", "--output", "{out}/t.json"], None, 2, "is empty"),
    ("mtnlg-train-tokenizer", ["--input", "{good}", "--output", "{good}"], None, 2, "is the input"),
    (
        "mtnlg-train-tokenizer",
        ["--input", "{good}", "--output", "{out}/t.json", "--vocab-size", "0"],
        None,
        2,
        "integer >= 2",
    ),
    # tools/consolidate_checkpoint.py
    ("mtnlg-consolidate", ["{missing}", "{out}/m.safetensors"], None, 2, "does not exist"),
    ("mtnlg-consolidate", ["{emptydir}", "{out}/m.safetensors"], None, 2, "no manifest"),
    ("mtnlg-consolidate", ["{plain}", "{out}/m.safetensors"], None, 2, "not a checkpoint folder"),
    ("mtnlg-consolidate", ["{ckpt}", "{adir}"], None, 2, "is a directory"),
    ("mtnlg-consolidate", ["{ckpt}", "{ckpt}/meta.pt"], None, 2, "lies inside the input"),
    # tools/pipeline.py
    ("mtnlg-pipeline", ["{plain}"], None, 2, "is a file"),
    ("mtnlg-pipeline", ["{nonempty}"], None, 2, "not empty"),
    ("mtnlg-pipeline", [".", "--overwrite"], None, 2, "current directory"),
    ("mtnlg-pipeline", ["{out}", "--steps", "0"], None, 2, "positive integer"),
]


def fill(argument: str, files: Path, out: Path) -> str:
    names = {
        "missing": files / "missing.jsonl",
        "empty": files / "empty.jsonl",
        "adir": files / "adir",
        "emptydir": files / "emptydir",
        "plain": files / "plain.txt",
        "latin1": files / "latin1.jsonl",
        "good": files / "good.jsonl",
        "tasks": files / "tasks.jsonl",
        "ckpt": files / "ckpt",
        "tok": files / "tokenizer.json",
        "nonempty": files / "nonempty",
        "cp2": files / "cp2.yaml",
        "cp3": files / "cp3.yaml",
        "cp2_math": files / "cp2_math.yaml",
        "out": out,
        "tiny": ROOT / "configs" / "tiny.yaml",
    }
    return argument.format(**{k: str(v) for k, v in names.items()})


@pytest.mark.parametrize("tool, arguments, stdin, code, says", ROWS, ids=[f"{r[0]}-{i}" for i, r in enumerate(ROWS)])
def test_bad_input_is_one_line_and_an_exit_code(
    files, tmp_path, monkeypatch, capsys, tool, arguments, stdin, code, says
):
    monkeypatch.chdir(files / "nonempty")  # `.` is a non-empty folder that must survive
    argv = [fill(a, files, tmp_path / "out") for a in arguments]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8"))
    try:
        got = _main(tool)(argv)
    except SystemExit as exit_:
        got = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error" in line.lower()]  # (info lines, argparse usage aside)
    assert len(lines) == 1 and lines[0].startswith(f"{tool}: error: "), err
    assert says in lines[0] and got == code, (got, lines[0])
    assert (files / "nonempty" / "keep.txt").read_text() == "mine"
