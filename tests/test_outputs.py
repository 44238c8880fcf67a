"""Outputs replace, never destroy first: the shared writer (mtnlg_lightning.outputs) and each tool that used to
delete before it had a result -- a failed run leaves the previous result as it was; --overwrite refuses targets
that are, contain or lie inside an input, ., ~ or /; files and folders follow the umask."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.outputs import (
    StagedFile,
    atomic_path,
    atomic_write,
    check_output,
    kept_until_done,
    staged_dir,
)
from testing.checkpoint_fuzzing import make_checkpoint


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_002():
    old = os.umask(0o002)
    yield
    os.umask(old)


def test_atomic_write_keeps_the_previous_file_on_error_and_follows_the_umask(tmp_path, umask_002):
    target = tmp_path / "out.json"
    target.write_text("previous")
    with pytest.raises(RuntimeError), atomic_write(target, "w") as f:
        f.write("half")
        raise RuntimeError("failed mid-way")
    assert target.read_text() == "previous" and [p.name for p in tmp_path.iterdir()] == ["out.json"]
    with atomic_write(target, "w") as f:
        f.write("new")
    assert target.read_text() == "new" and mode(target) == 0o664


def test_atomic_path_and_a_staged_file_replace_only_when_complete_and_leave_no_temp_file(tmp_path, umask_002):
    """The writers that need a file name (tokenizers, safetensors) and the indexed dataset's .bin written over many
    calls go through the same staging as `atomic_write`."""
    target = tmp_path / "tokenizer.json"
    target.write_text("previous")
    with pytest.raises(RuntimeError), atomic_path(target) as temp:
        Path(temp).write_text("half")
        raise RuntimeError("failed mid-way")
    assert target.read_text() == "previous" and [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]
    with atomic_path(target, fsync=True) as temp:
        Path(temp).write_text("new")
        assert target.read_text() == "previous"  # not before the block ends
    assert target.read_text() == "new" and mode(target) == 0o664
    staged = StagedFile(tmp_path / "data.bin")
    Path(staged.temp).write_bytes(b"tokens")
    assert not (tmp_path / "data.bin").exists()
    staged.commit()
    assert (tmp_path / "data.bin").read_bytes() == b"tokens"
    dropped = StagedFile(tmp_path / "other.bin")
    dropped.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin", "tokenizer.json"]


def test_staged_dir_swaps_in_only_a_complete_result_with_umask_modes(tmp_path, umask_002):
    target = tmp_path / "export"
    target.mkdir()
    (target / "old.txt").write_text("previous")
    with pytest.raises(RuntimeError), staged_dir(target) as stage:
        (stage / "new.txt").write_text("half")
        raise RuntimeError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"] and (target / "old.txt").exists()
    with staged_dir(target) as stage:
        (stage / "new.txt").write_text("complete")
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert mode(target) == 0o775 and mode(target / "new.txt") == 0o664  # was 0700: unreadable to a team


def test_kept_until_done_puts_the_previous_result_back_when_a_run_fails(tmp_path):
    target = tmp_path / "run"
    target.mkdir()
    (target / "report.md").write_text("previous")
    with pytest.raises(MTNLGError), kept_until_done(target):
        (target / "partial").write_text("x")
        raise MTNLGError("a stage failed")
    assert [p.name for p in target.iterdir()] == ["report.md"] and len(list(tmp_path.iterdir())) == 1
    with kept_until_done(target):
        (target / "report.md").write_text("new")
    assert (target / "report.md").read_text() == "new" and len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize(
    "target, inputs, replaces_dir, match",
    [
        ("data/a.jsonl", ["data/a.jsonl"], False, "is the input"),
        ("ckpt/out", ["ckpt"], False, "lies inside the input"),
        ("runs", ["runs/step=3.ckpt"], True, "contains the input"),
        (".", [], True, "current directory"),
        ("/", [], True, "file-system root"),
    ],
)
def test_the_guard_refuses_with_one_line(tmp_path, monkeypatch, target, inputs, replaces_dir, match):
    monkeypatch.chdir(tmp_path)
    for folder in ("data", "ckpt", "runs/step=3.ckpt"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "data/a.jsonl").write_text("{}\n")
    with pytest.raises(MTNLGError, match=match) as caught:
        check_output(target, inputs, replaces_dir)
    assert "\n" not in str(caught.value)
    check_output("elsewhere", inputs, replaces_dir)  # an unrelated target passes


def test_the_guard_refuses_the_home_directory_and_its_parents(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home" / "me"))
    (tmp_path / "home" / "me").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for target in (tmp_path / "home" / "me", tmp_path / "home"):
        with pytest.raises(MTNLGError, match="home directory"):
            check_output(target, [], replaces_dir=True)


# ------------------------------------------------------------------------------------------------ the tools
@pytest.fixture
def checkpoint(tmp_path):
    folder = tmp_path / "runs" / "step=3.ckpt"
    folder.parent.mkdir()
    make_checkpoint(folder, tmp_path / "outside.safetensors")
    return folder


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("out", ["itself", "parent"])
def test_export_hf_overwrite_never_replaces_the_checkpoint_or_its_folder(checkpoint, capsys, out):
    """Before: `mtnlg-export-hf CKPT CKPT --overwrite` (or its parent) replaced the checkpoint with the export."""
    from mtnlg_lightning.interop.export_cli import main as export_main

    before = snapshot(checkpoint.parent)
    target = checkpoint if out == "itself" else checkpoint.parent
    assert export_main([str(checkpoint), str(target), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtnlg-export-hf: error: ") and "\n" not in err and "input" in err
    assert snapshot(checkpoint.parent) == before


def test_consolidate_refuses_to_write_into_the_checkpoint(checkpoint, capsys):
    from mtnlg_lightning.checkpoint.consolidate import main as consolidate_main

    before = snapshot(checkpoint)
    code = consolidate_main([str(checkpoint), str(checkpoint / "rank-00000.safetensors")])
    assert code == 2 and "lies inside the input" in capsys.readouterr().err
    assert snapshot(checkpoint) == before


def test_pipeline_overwrite_refuses_the_current_directory_and_keeps_a_failed_runs_previous(tmp_path, monkeypatch):
    from mtnlg_lightning.demo.pipeline.run import prepare_out_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(MTNLGError, match="current directory"):
        prepare_out_dir(Path(".").resolve(), overwrite=True)
    with pytest.raises(MTNLGError, match="not empty"):
        prepare_out_dir(tmp_path, overwrite=False)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def _dedup(inputs, out):
    from mtnlg_lightning.curation.dedup import DedupConfig, run_dedup

    return run_dedup(DedupConfig([str(p) for p in inputs], str(out), progress=False))


def test_dedup_keeps_the_previous_outputs_when_a_run_fails_on_bad_input(tmp_path):
    """Before: mtnlg-dedup removed its previous outputs before reading a line."""
    from mtnlg_lightning.corpora.jsonl import InputError

    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({"text": f"document number {i} " * 5}) + "\n" for i in range(6)))
    out = tmp_path / "out"
    _dedup([data], out)
    before = snapshot(out)
    data.write_text(data.read_text() + "not json\n")
    with pytest.raises(InputError):
        _dedup([data], out)
    assert snapshot(out) == before


def test_decontaminate_keeps_its_previous_report_when_a_run_fails_on_bad_input(tmp_path):
    """Before: mtnlg-decontaminate deleted its report before validating its input."""
    from mtnlg_lightning.corpora.jsonl import InputError
    from mtnlg_lightning.curation.decontaminate import DecontamConfig, run_decontaminate

    tasks, train = tmp_path / "tasks.jsonl", tmp_path / "train.jsonl"
    tasks.write_text(json.dumps({"task": "t", "text": "one two three four five six seven eight nine"}) + "\n")
    train.write_text(json.dumps({"text": "an ordinary training document"}) + "\n")
    cfg = DecontamConfig([str(tasks)], str(train), str(tmp_path / "out" / "clean.jsonl"), progress=False)
    run_decontaminate(cfg)
    before = snapshot(tmp_path / "out")
    assert "report.json" in before
    train.write_text(train.read_text() + '{"txt": "no text key"}\n')
    with pytest.raises(InputError):
        run_decontaminate(cfg)
    assert snapshot(tmp_path / "out") == before


def test_dedup_refuses_an_output_that_is_an_input(tmp_path):
    from mtnlg_lightning.corpora.jsonl import InputError

    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(InputError, match="is the input"):
        _dedup([data], tmp_path)
    assert data.read_text() == json.dumps({"text": "x"}) + "\n"
    shutil.rmtree(tmp_path / ".mtnlg-dedup-work", ignore_errors=True)
