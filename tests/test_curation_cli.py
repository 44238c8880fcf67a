"""End-to-end CLI runs (subprocess, as a user would) and bad-input handling: one line on stderr, exit 2,
no traceback, nothing partial left behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtnlg_lightning.demo.synthetic.near_duplicates import make_near_dup_corpus, make_tasks_and_training

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def tool(name, *args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "MTNLG_CURATION_CRASH_AT"}
    return subprocess.run(
        [sys.executable, str(TOOLS / name), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("name", ["dedup", "decontaminate", "synthetic"])
def test_help_documents_every_flag(name):
    import importlib

    script = {"dedup": "dedup.py", "decontaminate": "decontaminate.py", "synthetic": "make_near_dup_corpus.py"}[name]
    p = tool(script, "--help")
    assert p.returncode == 0 and "usage:" in p.stdout
    module = {"synthetic": "mtnlg_lightning.demo.synthetic.near_duplicates_cli"}.get(
        name, f"mtnlg_lightning.curation.{name}_cli"
    )
    parser = importlib.import_module(module).build_parser()
    for action in parser._actions:
        assert action.help and len(action.help) > 10, action.option_strings
        for opt in action.option_strings:
            assert opt in p.stdout


def test_dedup_end_to_end(tmp_path):
    recs = make_near_dup_corpus(150, seed=9, doc_chars=1200)
    a = write_jsonl(tmp_path / "a.jsonl", recs[:100])
    b = write_jsonl(tmp_path / "b.jsonl", recs[100:])
    p = tool(
        "dedup.py",
        a,
        b,
        "--output-dir",
        tmp_path / "out",
        "--priority",
        "b.jsonl,a.jsonl",
        "--workers",
        "2",
        "--shingle",
        "word:5",
        "--threshold",
        "0.8",
        "--seed",
        "1",
    )
    assert p.returncode == 0, p.stderr
    assert "mtnlg-dedup summary" in p.stdout and "P(cand)" in p.stdout and len(p.stdout.splitlines()) <= 20
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["settings"]["priority"] == ["b.jsonl", "a.jsonl"]
    kept = sum(1 for _ in open(tmp_path / "out" / "a.jsonl")) + sum(1 for _ in open(tmp_path / "out" / "b.jsonl"))
    dups = sum(1 for _ in open(tmp_path / "out" / "duplicates.jsonl"))
    assert (
        kept + dups == 150
        and dups == rep["totals"]["exact_duplicates_removed"] + rep["totals"]["near_duplicates_removed"]
    )
    p = tool("dedup.py", a, b, "--output-dir", tmp_path / "out2", "--preset", "mtnlg", "-q")
    assert p.returncode == 0, p.stderr
    rep = json.loads((tmp_path / "out2" / "report.json").read_text())
    assert (rep["banding"]["bands"], rep["banding"]["rows_per_band"], rep["settings"]["num_perm"]) == (20, 13, 260)
    assert rep["banding"]["candidate_probability"]["0.80"] == pytest.approx(0.6773, abs=1e-4)
    p = tool("dedup.py", a, "-o", tmp_path / "x", "--preset", "mtnlg", "--num-bands", "5")
    assert p.returncode == 2 and "preset" in p.stderr


def test_decontaminate_end_to_end(tmp_path):
    tasks, docs = make_tasks_and_training(50, 60, seed=1, doc_chars=1500, plant_fraction=0.3)
    t = write_jsonl(tmp_path / "tasks.jsonl", tasks)
    i = write_jsonl(tmp_path / "train.jsonl", docs)
    p = tool(
        "decontaminate.py",
        "--tasks",
        t,
        "--input",
        i,
        "--output",
        tmp_path / "o" / "clean.jsonl",
        "--workers",
        "2",
        "--max-ngram",
        "13",
        "--min-ngram",
        "8",
        "--window",
        "200",
        "--min-piece",
        "200",
        "--max-splits",
        "10",
        "--frequent-threshold",
        "10",
    )
    assert p.returncode == 0, p.stderr
    assert "mtnlg-decontaminate summary" in p.stdout
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rep["hits"]["documents"] >= 5 and rep["documents"]["in"] == 60
    out = [json.loads(x) for x in (tmp_path / "o" / "clean.jsonl").read_text().splitlines()]
    assert len(out) == rep["documents"]["records_out"] and all("split_id" in r and "id" in r for r in out)


BAD = {
    "missing file": (None, "no such file"),
    "invalid json": ('{"text": "ok"}\n{"text": "fine"}\n{"text": broken\n', ":3: invalid JSON"),
    "missing key": ('{"text": "ok"}\n{"body": "no text"}\n', ":2: missing text key 'text'"),
    "not a string": ('{"text": 5}\n', ":1: text key 'text' is int"),
    "empty": ("", "empty input"),
    "blank lines only": ("\n\n", "empty input"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_dedup_bad_input(tmp_path, case):
    content, msg = BAD[case]
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "some words here for a document"}])
    bad = tmp_path / "bad.jsonl"
    if content is not None:
        bad.write_text(content)
    out = tmp_path / "out"
    p = tool("dedup.py", good, bad, "-o", out, "-q", "--shard-mb", "1")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr and msg in lines[0] and "bad.jsonl" in lines[0]
    assert not out.exists()  # nothing partial left behind (the output dir was created by the run: removed)


@pytest.mark.parametrize("case", ["missing file", "invalid json", "missing key", "empty"])
def test_decontaminate_bad_input(tmp_path, case):
    content, msg = BAD[case]
    tasks = write_jsonl(tmp_path / "tasks.jsonl", [{"task": "t", "text": "one two three four five six seven eight"}])
    bad = tmp_path / "bad.jsonl"
    if content is not None:
        bad.write_text(content)
    for args in (["--tasks", tasks, "--input", bad], ["--tasks", bad, "--input", tasks]):
        p = tool("decontaminate.py", *args, "--output", tmp_path / "o" / "out.jsonl", "-q")
        assert p.returncode == 2
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr and "bad.jsonl" in lines[0]
        assert msg in lines[0] or (case == "empty" and "empty input" in lines[0])
        assert not (tmp_path / "o").exists() or list((tmp_path / "o").iterdir()) == []
