"""The paper's task table in one command: `mtnlg-eval --suite` runs each row at its numbers of shots and writes the
table in the paper's shape, with the same numbers as `lm_eval --model hf` on the exported model (local copies of the
harness' own task definitions of LAMBADA, PiQA and BoolQ, reading small local slices in their formats) and, for a
native row (HANS), as `mtnlg-eval --task hans`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from test_evaluation import checkpoint, cloze, tokenizer_path  # noqa: F401 - fixtures

from mtnlg_lightning.evaluation.cli import main as eval_main
from mtnlg_lightning.evaluation.suite import read_suite, table_paths
from mtnlg_lightning.interop.export_cli import main as export_main

HANS = ROOT / "tests" / "data" / "hans_sample.jsonl"
SHOTS = [0, 1, 3]
LOCAL = {"lambada_openai": "local_lambada", "piqa": "local_piqa", "boolq": "local_boolq"}


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def slices(cloze_path: Path, directory: Path) -> dict[str, dict[str, str]]:
    """Per task, {split: file}: PiQA-format items (a passage's opening as the goal, its own ending and another
    passage's as the two solutions) and BoolQ-format items (a passage and a yes/no question) from the held-out cloze
    passages, and LAMBADA passages; each a train split for the in-context examples and an evaluation split."""
    passages = [json.loads(line)["text"] for line in cloze_path.read_text().splitlines()]
    rng = random.Random(0)
    piqa, boolq = [], []
    for i, text in enumerate(passages[:24]):  # short items: the tiny model's 64 positions hold the examples
        words, other = text.split(), passages[(i + 7) % len(passages)].split()
        goal, ending, wrong = " ".join(words[:6]), " ".join(words[6:10]), " ".join(other[6:10])
        label = rng.randrange(2)
        piqa.append({"goal": goal, "sol1": [ending, wrong][label], "sol2": [wrong, ending][label], "label": label})
        question = f"is it about {rng.choice(words).strip('.,;:')}"
        boolq.append({"passage": " ".join(words[:8]), "question": question, "label": rng.randrange(2)})
    lambada = [{"text": t} for t in passages[:16]]
    out = {}
    for task, records, split in (
        ("piqa", piqa, "validation"),
        ("boolq", boolq, "validation"),
        ("lambada", lambada, "test"),
    ):
        out[task] = {"train": write_jsonl(directory / f"{task}_train.jsonl", records[16:] or records[:4])}
        out[task][split] = write_jsonl(directory / f"{task}_{split}.jsonl", records[:16])
    return out


def local_task_dir(directory: Path, data: dict[str, dict[str, str]]) -> Path:
    """The installed harness' own YAML of each task, reading the local files instead of the Hub's."""
    import lm_eval

    tasks = Path(lm_eval.__file__).parent / "tasks"
    sources = {
        "lambada_openai": "lambada/lambada_openai.yaml",
        "piqa": "piqa/piqa.yaml",
        "boolq": "super_glue/boolq/default.yaml",
    }
    directory.mkdir()
    for name, source in sources.items():
        config = yaml.safe_load((tasks / source).read_text())
        files = data[name.split("_")[0]]
        config.update(task=LOCAL[name], dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": files})
        config.pop("tag", None)
        if "train" in files and name != "lambada_openai":
            config["training_split"] = "train"
        (directory / f"{LOCAL[name]}.yaml").write_text(yaml.safe_dump(config))
    return directory


def suite_file(path: Path, tasks_dir: Path) -> Path:
    rows = [
        {"row": "LAMBADA", "group": "completion", "harness": "local_lambada", "metric": "acc", "shots": SHOTS},
        {"row": "PiQA", "group": "commonsense", "harness": "local_piqa", "metric": "acc_norm", "shots": SHOTS},
        {"row": "BoolQ", "group": "reading", "harness": "local_boolq", "metric": "acc", "shots": SHOTS},
        {"row": "HANS", "group": "inference", "native": "hans", "metric": "acc", "shots": [0, 2], "data": str(HANS)},
    ]
    path.write_text(yaml.safe_dump({"name": "small", "include_path": tasks_dir.name, "tasks": rows}))
    return path


@pytest.mark.slow
def test_suite_table_equals_lm_eval_hf_on_the_exported_model(checkpoint, tokenizer_path, cloze, tmp_path, capsys):  # noqa: F811
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    tasks_dir = local_task_dir(tmp_path / "tasks", slices(cloze, tmp_path))
    suite = suite_file(tmp_path / "small.yaml", tasks_dir)
    base = ["--checkpoint", str(checkpoint), "--tokenizer", tokenizer_path, "--no-progress", "--dtype", "fp32"]
    argv = [*base, "--suite", str(suite), "--table", str(tmp_path / "table"), "--output", str(tmp_path / "r.json")]
    assert eval_main(argv) == 0
    printed = capsys.readouterr().out
    ours = json.loads((tmp_path / "r.json").read_text())

    exported = tmp_path / "hf"
    assert export_main([str(checkpoint), str(exported), "--tokenizer", tokenizer_path]) == 0
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    for k in SHOTS:
        theirs = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={exported},dtype=float32",
            tasks=list(LOCAL.values()),
            task_manager=manager,
            num_fewshot=k,
            batch_size=8,
            device="cpu",
        )["results"]
        for row, task in (("LAMBADA", "local_lambada"), ("PiQA", "local_piqa"), ("BoolQ", "local_boolq")):
            mine = ours["results"][row][str(k)]
            for metric in ("acc", "acc_norm"):
                if f"{metric},none" in theirs[task]:
                    assert mine[metric] == theirs[task][f"{metric},none"], (row, k, metric)
            if row == "LAMBADA":
                assert mine["perplexity"] == pytest.approx(theirs[task]["perplexity,none"], rel=1e-4)
    assert 0 < ours["results"]["LAMBADA"]["0"]["acc"] < 1  # non-trivial, so equality means something

    # The native row is the native task.
    hans = ["--task", "hans", "--data", str(HANS), "--shots", "0", "2", "--output", str(tmp_path / "hans.json")]
    assert eval_main([*base, *hans]) == 0
    capsys.readouterr()
    assert ours["results"]["HANS"] == json.loads((tmp_path / "hans.json").read_text())["results"]["hans"]

    # The table: a row per task, columns 0 / 1 / few shots, the row's metric; markdown printed and written, JSON.
    markdown, table = (p.read_text() for p in table_paths(str(tmp_path / "table")))
    rows = json.loads(table)["rows"]
    assert [r["task"] for r in rows] == ["LAMBADA", "PiQA", "BoolQ", "HANS"] and rows == ours["table"]
    for r in rows:
        found = ours["results"][r["task"]]
        few = 3 if r["task"] != "HANS" else 2
        assert (r["zero_shot"], r["few_shot"], r["few_shot_k"]) == (
            found["0"][r["metric"]],
            found[str(few)][r["metric"]],
            few,
        )
        assert r["one_shot"] == (found["1"][r["metric"]] if r["task"] != "HANS" else None)
        assert f"| {r['task']} | {r['group']} |" in markdown and f"{r['zero_shot']:.4f}" in markdown
    assert markdown.strip() in printed


def test_the_shipped_suite_is_the_papers_eight_tasks(tmp_path):
    hans = tmp_path / "hans.jsonl"
    hans.write_text(HANS.read_text())
    suite = read_suite("mtnlg", [f"HANS={hans}"])
    assert [r.row for r in suite.rows] == [
        "LAMBADA",
        "RACE-h",
        "BoolQ",
        "PiQA",
        "HellaSwag",
        "WinoGrande",
        "ANLI-R2",
        "HANS",
    ]
    harness = [r.harness for r in suite.rows if r.harness]
    assert harness == ["lambada_openai", "race", "boolq", "piqa", "hellaswag", "winogrande", "anli_r2"]
    assert all(r.shots[:2] == (0, 1) and r.few_shot > 1 for r in suite.rows)
    assert suite.rows[-1].native == "hans" and suite.rows[-1].data == str(hans)
