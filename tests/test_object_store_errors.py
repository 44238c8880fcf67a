"""Bad object-storage input is one line and exit status 2, before any work: a bucket or key that does not exist,
credentials the store refuses, a URL scheme with no installed file system, a missing [cloud] extra, an output URL
that cannot be written. (moto's S3 server on 127.0.0.1; a second one that checks credentials for the refusal.)"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tool_main

from mtnlg_lightning.curation import decontaminate_cli, dedup_cli
from mtnlg_lightning.errors import MTNLGError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTNLG_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def bucket(s3):
    """A bucket holding one good corpus file, s3://B/in/a.jsonl."""
    name = s3.new_bucket()
    s3.put(
        f"s3://{name}/in/a.jsonl", b"".join(b'{"text": "one two three four five six seven %d"}\n' % i for i in range(9))
    )
    return name


def one_line_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{prog}: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("s3://mtnlg-no-such-bucket/in/a.jsonl", "no such bucket"),
        ("s3://{bucket}/in/missing.jsonl", "no such file"),
        ("s3://{bucket}/nothing-here/", "no such file"),
        ("gs://{bucket}/in/a.jsonl", "no installed file system for gs:// URLs"),
        ("s3x://{bucket}/in/a.jsonl", "no file system knows s3x:// URLs"),
    ],
)
def test_a_bad_input_url_is_one_line_before_any_work(bucket, where, expected, tmp_path, capsys):
    if where.startswith("gs://") and importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here: gs:// has a file system")
    url = where.format(bucket=bucket)
    assert dedup_cli.main([url, "-o", str(tmp_path / "out"), "-q"]) == 2
    assert expected in one_line_error(capsys, "mtnlg-dedup") and url in capsys.readouterr().err + url
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("tool", "args"),
    [
        ("decontaminate", ["--tasks", "{good}", "--input", "{missing}", "--output", "{out}/clean.jsonl", "-q"]),
        ("preprocess_data", ["--input", "{missing}", "--tokenizer", "{out}/tok", "--output-prefix", "{out}/c"]),
        ("train_tokenizer", ["--input", "{missing}", "--output", "{out}/tok"]),
        ("quality", ["annotate", "{missing}", "-o", "{out}/q", "-q"]),
    ],
)
def test_every_tool_names_a_missing_object_in_one_line(bucket, tool, args, tmp_path, capsys):
    urls = {"good": f"s3://{bucket}/in/a.jsonl", "missing": f"s3://{bucket}/in/gone.jsonl", "out": str(tmp_path)}
    argv = [a.format(**urls) for a in args]
    if tool == "decontaminate":
        code, prog = decontaminate_cli.main(argv), "mtnlg-decontaminate"
    elif tool == "quality":
        from mtnlg_lightning.crawl import quality_cli

        code, prog = quality_cli.main(argv), "mtnlg-quality"
    else:
        code, prog = tool_main(tool)(argv), {"preprocess_data": "mtnlg-preprocess"}.get(tool, "mtnlg-train-tokenizer")
    assert code == 2
    assert f"s3://{bucket}/in/gone.jsonl" in one_line_error(capsys, prog)


def test_an_output_url_that_cannot_be_written_is_one_line_before_any_work(bucket, s3, capsys):
    good = f"s3://{bucket}/in/a.jsonl"
    assert dedup_cli.main([good, "-o", "s3://mtnlg-no-such-bucket/out", "-q"]) == 2
    assert "no such bucket" in one_line_error(capsys, "mtnlg-dedup")
    assert dedup_cli.main([good, "-o", f"{s3.endpoint}/{bucket}/out", "-q"]) == 2
    assert "read-only" in one_line_error(capsys, "mtnlg-dedup")
    assert dedup_cli.main([good, "-o", f"s3://{bucket}/in", "-q"]) == 2  # its output would be its input
    assert "is the input" in one_line_error(capsys, "mtnlg-dedup")
    assert s3.keys(f"s3://{bucket}") == ["in/a.jsonl"]


def test_credentials_the_store_refuses_are_one_line(bucket, tmp_path):
    from object_store import refusing_server

    with refusing_server() as endpoint:
        env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "MTNLG_CACHE": str(tmp_path / "cache")}
        url = f"s3://{bucket}/in/a.jsonl"
        done = subprocess.run(
            [sys.executable, "-m", "mtnlg_lightning.curation.dedup_cli", url, "-o", str(tmp_path / "out"), "-q"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert done.returncode == 2
    err = done.stderr.strip()
    assert err.startswith("mtnlg-dedup: error: ") and "\n" not in err and "access denied" in err
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in err  # the credentials are never printed


def test_without_the_cloud_extra_a_url_is_one_line_naming_it(bucket, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # as if fsspec were not installed: importing it fails
    assert dedup_cli.main([f"s3://{bucket}/in/a.jsonl", "-o", str(tmp_path / "out"), "-q"]) == 2
    assert "pip install 'mtnlg-lightning[cloud]'" in one_line_error(capsys, "mtnlg-dedup")


def test_a_training_dataset_url_that_does_not_exist_is_one_line(bucket):
    from mtnlg_lightning.data.indexed import IndexedDataset

    for prefix, expected in (
        ("s3://mtnlg-no-such-bucket/data/c", "no such bucket"),
        (f"s3://{bucket}/data/missing", "missing dataset file"),
    ):
        with pytest.raises(MTNLGError, match=expected) as raised:
            IndexedDataset(prefix)
        assert "\n" not in str(raised.value) and prefix in str(raised.value)


def test_the_pipeline_keeps_its_overwrite_rules_for_an_output_prefix(bucket, capsys):
    pytest.importorskip("transformers")  # the pipeline's export stage, checked before anything else
    pipeline = tool_main("pipeline")
    assert pipeline([f"s3://{bucket}/in", "--smoke", "--no-plot"]) == 2  # not empty, no --overwrite
    assert "pass --overwrite" in one_line_error(capsys, "mtnlg-pipeline")
    assert pipeline([f"s3://{bucket}", "--smoke", "--no-plot", "--overwrite"]) == 2
    assert "whole bucket" in one_line_error(capsys, "mtnlg-pipeline")
