"""tools/train_tokenizer.py and tools/preprocess_data.py as a user runs them."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

from mtnlg_lightning.data.indexed import IndexedDataset
from mtnlg_lightning.data.tokenizer import Tokenizer, train_bpe


def tool(name, *args):
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / name), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_train_tokenizer_then_preprocess_writes_documents_with_eod(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    docs = [f"Document number {i} talks about the weather and the sea, item {i * 7}." for i in range(200)]
    corpus.write_text("".join(json.dumps({"content": d}) + "\n" for d in docs))
    out = tool(
        "train_tokenizer.py",
        "--input",
        str(corpus),
        "--json-key",
        "content",
        "--vocab-size",
        "400",
        "--output",
        str(tmp_path / "tok"),
    )
    assert out.returncode == 0, out.stderr
    out = tool(
        "preprocess_data.py",
        "--input",
        str(corpus),
        "--json-key",
        "content",
        "--tokenizer",
        str(tmp_path / "tok"),
        "--output-prefix",
        str(tmp_path / "data" / "c"),
        "--workers",
        "2",
    )
    assert out.returncode == 0, out.stderr
    assert "200 documents" in out.stdout and "tokens/s" in out.stdout
    dataset, tokenizer = IndexedDataset(tmp_path / "data" / "c"), Tokenizer(tmp_path / "tok")
    assert len(dataset) == 200
    assert tokenizer.decode(dataset[17][:-1]) == docs[17] and dataset[17][-1] == tokenizer.eod_id


@pytest.mark.slow
def test_preprocess_reports_a_bad_line_with_its_number_and_writes_nothing(tmp_path):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": broken\n')
    train_bpe(["some text"] * 5, 300, tmp_path / "tok")
    out = tool(
        "preprocess_data.py",
        "--input",
        str(corpus),
        "--tokenizer",
        str(tmp_path / "tok"),
        "--output-prefix",
        str(tmp_path / "o"),
    )
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith(f"mtnlg-preprocess: error: {corpus}:2: invalid JSON: Expecting value")
    )
    assert not list(tmp_path.glob("o.*"))


@pytest.mark.slow
def test_tools_explain_every_flag_in_help():
    for name in ("preprocess_data.py", "train_tokenizer.py"):
        out = tool(name, "--help")
        assert out.returncode == 0
        for flag in ("--input", "--json-key"):
            assert flag in out.stdout
