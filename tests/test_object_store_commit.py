"""Outputs on S3 commit: a run that is killed (in its stages, or while it uploads its outputs) or fails on bad input
leaves the previous committed output readable and unchanged, and shows no partial output to a reader; the killed run
re-run resumes and commits. (moto's S3 server on 127.0.0.1.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from curation_faults import CRASH_ENV, Faults, SimulatedCrash
from object_store import local_tree

from mtnlg_lightning.corpora.sources import expand_inputs
from mtnlg_lightning.curation.dedup import DedupConfig, run_dedup
from mtnlg_lightning.demo.synthetic.near_duplicates import make_near_dup_corpus

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTNLG_CACHE", str(tmp_path / "cache"))


def jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.fixture(scope="module")
def corpus():
    records = make_near_dup_corpus(160, seed=11, doc_chars=700)
    return records[:80], records[80:]


@pytest.fixture
def committed(s3, corpus):
    """A bucket with web.jsonl and books.jsonl, and a first dedup of web.jsonl alone committed to s3://B/out:
    (bucket, the committed objects)."""
    bucket = s3.new_bucket()
    s3.put(f"s3://{bucket}/in/web.jsonl", jsonl(corpus[0]))
    s3.put(f"s3://{bucket}/in/books.jsonl", jsonl(corpus[1]))
    run_dedup(config(bucket, ["web.jsonl"]))
    before = s3.tree(f"s3://{bucket}/out")
    assert set(before) == {"web.jsonl", "duplicates.jsonl", "report.json"}
    return bucket, before


def config(bucket: str, names: list[str], **kw) -> DedupConfig:
    inputs = [f"s3://{bucket}/in/{n}" for n in names]
    return DedupConfig(inputs, f"s3://{bucket}/out", shard_bytes=16 << 10, progress=False, **kw)


def visible(bucket: str) -> list[str]:
    """What a reader of the output prefix sees (the tools' own listing)."""
    return sorted(f.name for f in expand_inputs([f"s3://{bucket}/out"]))


def test_a_dedup_run_killed_in_its_stages_leaves_the_committed_output_and_resumes(s3, committed, tmp_path):
    bucket, before = committed
    with pytest.raises(SimulatedCrash), Faults(crash_at="verify:task2", raise_instead=True):
        run_dedup(config(bucket, ["web.jsonl", "books.jsonl"]))
    assert s3.tree(f"s3://{bucket}/out") == before  # not one object added, changed or removed
    assert visible(bucket) == ["duplicates.jsonl", "report.json", "web.jsonl"]
    report = run_dedup(config(bucket, ["web.jsonl", "books.jsonl"]))
    assert report["resumed_stages"] == ["signatures", "buckets"]  # the killed run's work was kept locally
    reference = run_dedup(DedupConfig([str(p) for p in write_inputs(tmp_path, s3, bucket)], str(tmp_path / "ref")))
    after = s3.tree(f"s3://{bucket}/out")
    assert {k: v for k, v in after.items() if k != "report.json"} == {
        k: v for k, v in local_tree(tmp_path / "ref").items() if k != "report.json"
    }
    assert reference["totals"] == report["totals"]


def write_inputs(tmp_path: Path, s3, bucket: str) -> list[Path]:
    paths = []
    for name in ("web.jsonl", "books.jsonl"):
        path = tmp_path / "local" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(s3.get(f"s3://{bucket}/in/{name}"))
        paths.append(path)
    return paths


def killed_process(bucket: str, crash_at: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """`mtnlg-dedup` of both inputs to s3://B/out in a process that dies (os._exit) at ``crash_at``."""
    args = [f"s3://{bucket}/in/web.jsonl", f"s3://{bucket}/in/books.jsonl", "-o", f"s3://{bucket}/out", "-q"]
    env = {**os.environ, CRASH_ENV: crash_at, "MTNLG_CACHE": str(tmp_path / "cache")}
    return subprocess.run(
        [sys.executable, str(TESTS / "curation_faults.py"), "dedup", *args, "--shard-mb", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("crash_at", ["buckets", "commit:upload:3", "commit:copy:1"])
def test_a_dedup_process_killed_mid_way_or_mid_commit_shows_no_partial_output(s3, committed, crash_at, tmp_path):
    bucket, before = committed
    done = killed_process(bucket, crash_at, tmp_path)
    assert done.returncode == 86, done.stderr[-2000:]  # died where it was told to
    after = s3.tree(f"s3://{bucket}/out")
    visible_after = {k: v for k, v in after.items() if not k.startswith(".")}
    if crash_at == "commit:copy:1":
        # killed between the copies: the report (the marker of a complete result) is gone first, so no reader
        # takes the mix for a finished result; the re-run below completes it
        assert "report.json" not in visible_after
    else:
        assert visible_after == before  # the committed output, unchanged
        assert visible(bucket) == ["duplicates.jsonl", "report.json", "web.jsonl"]
    hidden = set(after) - set(visible_after)
    assert all(k.startswith(".mtnlg-staging-") for k in hidden)
    assert bool(hidden) == crash_at.startswith("commit:")  # the staged objects a killed commit left, hidden
    report = run_dedup(config(bucket, ["web.jsonl", "books.jsonl"]))
    final = s3.tree(f"s3://{bucket}/out")
    assert set(final) == {"web.jsonl", "books.jsonl", "duplicates.jsonl", "report.json"}  # stale staging cleared
    assert json.loads(final["report.json"])["totals"] == report["totals"]


def test_a_dedup_run_failing_on_bad_input_leaves_the_committed_output(s3, committed, corpus, capsys):
    from mtnlg_lightning.curation import dedup_cli

    bucket, before = committed
    s3.put(f"s3://{bucket}/in/broken.jsonl", jsonl(corpus[1][:30]) + b'{"text": broken\n')
    args = [f"s3://{bucket}/in/web.jsonl", f"s3://{bucket}/in/broken.jsonl", "-o", f"s3://{bucket}/out", "-q"]
    assert dedup_cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtnlg-dedup: error: ") and "\n" not in err and "broken.jsonl:31" in err
    assert s3.tree(f"s3://{bucket}/out") == before  # nothing of the failed run, hidden or not
    assert not any((Path(os.environ["MTNLG_CACHE"]) / "scratch").glob("*"))  # and nothing left locally


def test_a_failed_preprocess_leaves_the_committed_dataset(s3, tmp_path, capsys):
    import importlib.util

    from mtnlg_lightning.data.tokenizer import train_bpe

    spec = importlib.util.spec_from_file_location("tool_preprocess", TESTS.parent / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(TESTS.parent / "tools"))
    spec.loader.exec_module(module)
    texts = [f"a short text about the number {i} and the letters it has" for i in range(50)]
    train_bpe(texts, 280, tmp_path / "tok")
    bucket = s3.new_bucket()
    s3.put(f"s3://{bucket}/good.jsonl", jsonl([{"text": t} for t in texts]))
    s3.put(f"s3://{bucket}/bad.jsonl", jsonl([{"text": t} for t in texts[:5]]) + b"{not json\n")
    args = ["--tokenizer", str(tmp_path / "tok"), "--output-prefix", f"s3://{bucket}/data/c", "--no-progress"]
    assert module.main(["--input", f"s3://{bucket}/good.jsonl", *args]) == 0
    before = s3.tree(f"s3://{bucket}/data")
    assert set(before) == {"c.bin", "c.idx"}
    assert module.main(["--input", f"s3://{bucket}/bad.jsonl", *args]) == 2
    assert "bad.jsonl:6" in capsys.readouterr().err
    assert s3.tree(f"s3://{bucket}/data") == before


def test_a_replacing_commit_removes_what_the_new_result_lacks_and_nothing_hidden(s3, tmp_path):
    from mtnlg_lightning.corpora.commit import destination

    bucket = s3.new_bucket()
    for key, data in (("run/a.txt", b"old a"), ("run/b.txt", b"old b"), ("run/.keep/x", b"hidden")):
        s3.put(f"s3://{bucket}/{key}", data)
    dest = destination(f"s3://{bucket}/run")
    Path(dest.local, "a.txt").write_bytes(b"new a")
    Path(dest.local, "sub").mkdir()
    Path(dest.local, "sub", "c.txt").write_bytes(b"new c")
    dest.publish(["a.txt", "sub/c.txt"], markers=1, replace=True)
    assert s3.tree(f"s3://{bucket}/run") == {"a.txt": b"new a", "sub/c.txt": b"new c", ".keep/x": b"hidden"}
    assert not Path(dest.local).exists()  # the scratch folder goes with the commit
