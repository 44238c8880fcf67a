"""The checkpoint format in one process: pieces and boxes, crash-safe publication, integrity, bad input, resume,
keep-last-k, consolidation."""

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli
from lightning.pytorch.callbacks import Callback

from mtnlg_lightning.checkpoint.commit import newest_complete, prepare_staging, publish, staging_path
from mtnlg_lightning.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    Piece,
    TensorReader,
    read_manifest,
    verify_files,
    write_manifest,
    write_pieces,
)
from testing.parallel_harness import tiny_run


def write_checkpoint(directory: Path, pieces_by_file: dict[str, list[Piece]], step: int = 0) -> Path:
    staging = prepare_staging(directory)
    files = [write_pieces(staging, name, pieces) for name, pieces in pieces_by_file.items()]
    write_manifest(staging, files, {"global_step": step})
    publish(staging, directory)
    return directory


def test_boxes_written_by_several_ranks_read_back_in_any_other_box(tmp_path):
    full = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    # Rank 0 and 1 each hold half the columns (a row-parallel weight), rank 2 nothing of it.
    pieces = {
        "rank-0.safetensors": [Piece("w", full[:, :4].clone(), (0, 0), (6, 8))],
        "rank-1.safetensors": [Piece("w", full[:, 4:].clone(), (0, 4), (6, 8))],
        "rank-2.safetensors": [],
    }
    path = write_checkpoint(tmp_path / "c.ckpt", pieces)
    reader = TensorReader(path, read_manifest(path))
    assert torch.equal(reader.read("w"), full)
    assert torch.equal(reader.read("w", (2, 3), (3, 2)), full[2:5, 3:5])  # crosses the two pieces
    assert torch.equal(reader.read("w", (3, 0), (3, 8)), full[3:])  # a row shard of another TP layout


def test_flat_fragments_of_two_ranks_read_back_as_row_and_column_boxes(tmp_path):
    """ZeRO-1/2 fragments are flat ranges of the row-major tensor, cut anywhere (here mid-row)."""
    full = torch.arange(5 * 6, dtype=torch.float32).reshape(5, 6)
    flat = full.flatten()
    pieces = {
        "rank-0.safetensors": [Piece("m", flat[:13].clone(), (), (5, 6), flat_start=0)],
        "rank-1.safetensors": [Piece("m", flat[13:].clone(), (), (5, 6), flat_start=13)],
    }
    path = write_checkpoint(tmp_path / "c.ckpt", pieces)
    reader = TensorReader(path, read_manifest(path))
    assert torch.equal(reader.read("m"), full)
    assert torch.equal(reader.read("m", (1, 3), (3, 3)), full[1:4, 3:6])  # a column shard of another TP layout
    assert torch.equal(reader.read("m", (2, 0), (2, 6)), full[2:4])


def test_a_missing_piece_is_an_error_not_zeros(tmp_path):
    path = write_checkpoint(tmp_path / "c.ckpt", {"r0.safetensors": [Piece("w", torch.ones(2, 4), (0, 0), (4, 4))]})
    with pytest.raises(CheckpointError, match="cover 8 of its 16 elements"):  # before any tensor is read
        read_manifest(path)


def test_an_interrupted_save_is_never_taken_for_a_checkpoint_and_never_damages_the_previous(tmp_path):
    one = write_checkpoint(tmp_path / "step=1.ckpt", {"r.safetensors": [Piece("w", torch.ones(2), (0,), (2,))]}, 1)
    staging = prepare_staging(tmp_path / "step=2.ckpt")  # killed while writing: files, no manifest
    write_pieces(staging, "r.safetensors", [Piece("w", torch.zeros(2), (0,), (2,))])
    assert staging == staging_path(tmp_path / "step=2.ckpt") and staging.name.startswith(".")
    (tmp_path / "last.ckpt").symlink_to("step=1.ckpt")
    assert newest_complete(tmp_path) == one
    with pytest.raises(RuntimeError, match="incomplete"):
        publish(staging, tmp_path / "step=2.ckpt")
    # A later save of the same name starts clean and replaces atomically.
    two = write_checkpoint(
        tmp_path / "step=2.ckpt", {"r.safetensors": [Piece("w", torch.full((2,), 2.0), (0,), (2,))]}, 2
    )
    assert newest_complete(tmp_path) == two and not staging.exists()
    assert torch.equal(TensorReader(one, read_manifest(one)).read("w"), torch.ones(2))


def test_the_newest_complete_search_spans_folders_and_stops_at_a_step(tmp_path):
    """The loss-spike rewind's question: the newest complete checkpoint at or before a step, in any of its folders."""
    piece = {"r.safetensors": [Piece("w", torch.ones(2), (0,), (2,))]}
    two = write_checkpoint(tmp_path / "a" / "step=2.ckpt", piece, 2)
    four = write_checkpoint(tmp_path / "b" / "step=4.ckpt", piece, 4)
    write_checkpoint(tmp_path / "a" / "step=6.ckpt", piece, 6)
    folders = (tmp_path / "a", tmp_path / "b", tmp_path / "missing")
    assert newest_complete(*folders, max_step=5) == four
    assert newest_complete(*folders, max_step=3) == two
    assert newest_complete(*folders, max_step=1) is None
    assert newest_complete(*folders).name == "step=6.ckpt"


@pytest.mark.parametrize("damage", ["truncate", "delete", "alter"])
def test_integrity_check_names_the_damaged_file(tmp_path, damage):
    path = write_checkpoint(tmp_path / "c.ckpt", {"rank-00000.safetensors": [Piece("w", torch.ones(64), (0,), (64,))]})
    target = path / "rank-00000.safetensors"
    damage_file(target, damage)
    problem = verify_files(path, read_manifest(path))
    assert problem is not None and str(target) in problem


def damage_file(target: Path, how: str) -> None:
    if how == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2])
    elif how == "delete":
        target.unlink()
    else:  # same size, one byte flipped
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))


def test_manifest_is_json_and_nothing_in_the_checkpoint_needs_pickle(tmp_path):
    path = write_checkpoint(tmp_path / "c.ckpt", {"r.safetensors": [Piece("w", torch.ones(3), (0,), (3,))]})
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format"] == "mtnlg-checkpoint" and manifest["files"]["r.safetensors"]["xxh64"]


# ------------------------------------------------------------------------------------------------ through Lightning
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 single-process steps of the tiny model, checkpointed at step 3 (and a 6-step reference)."""
    from mtnlg_lightning.checkpoint import ModelCheckpoint

    out = tmp_path_factory.mktemp("trained")
    reference, _ = tiny_run(max_steps=6, capture_steps=(6,))
    callback = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=3, filename="{step}", save_top_k=-1)
    first, _ = tiny_run(max_steps=3, capture_steps=(), callbacks=[callback])
    return {"dir": out / "ckpt", "reference": reference, "first": first}


@pytest.mark.slow
def test_single_process_resume_is_bit_identical_and_the_tokenizer_travels(trained):
    path = trained["dir"] / "step=3.ckpt"
    assert (path / "tokenizer.json").is_file() and os.path.islink(trained["dir"] / "last.ckpt")
    resumed, _ = tiny_run(max_steps=6, capture_steps=(6,), ckpt_path=path)
    assert trained["first"].losses + resumed.losses == trained["reference"].losses
    for name, value in trained["reference"].params[6].items():
        assert torch.equal(value, resumed.params[6][name]), name


@pytest.mark.slow
def test_keep_last_k_prunes_only_after_the_newer_save_is_complete(tmp_path):
    from mtnlg_lightning.checkpoint import ModelCheckpoint

    callback = ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=1, filename="{step}", save_top_k=2, monitor="step", mode="max"
    )
    tiny_run(max_steps=4, capture_steps=(), callbacks=[callback])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["last.ckpt", "step=3.ckpt", "step=4.ckpt"]
    assert os.readlink(tmp_path / "last.ckpt") == "step=4.ckpt"  # a link: no second copy of the bytes


class SigtermDuringBatch(Callback):
    """SIGTERM to this process before batch `batch_idx`, as a launcher sends it on a preemption or a node's join."""

    def __init__(self, batch_idx: int):
        self.batch_idx = batch_idx

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch_idx:
            os.kill(os.getpid(), signal.SIGTERM)


class SavedSteps(Callback):
    def __init__(self):
        self.steps = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.steps.append(trainer.global_step)


def test_a_preemption_on_a_step_of_the_save_cadence_writes_that_step_once(tmp_path):
    """The signal comes during the second step: step 2 is both the preemption's boundary and a periodic save's, and
    the run's first save (so Lightning would also write a full `last.ckpt` at the end of training)."""
    from mtnlg_lightning.checkpoint import ModelCheckpoint

    saved = SavedSteps()
    callback = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, filename="{step}", save_top_k=-1)
    _, trainer = tiny_run(max_steps=6, capture_steps=(), callbacks=[SigtermDuringBatch(1), saved, callback])
    assert trainer.global_step == 2 and saved.steps == [2]
    assert newest_complete(tmp_path) == tmp_path / "step=2.ckpt"
    assert os.readlink(tmp_path / "last.ckpt") == "step=2.ckpt"  # the preemption's save, linked, not copied


@pytest.mark.slow
def test_consolidated_file_holds_the_model_space_weights(trained, tmp_path):
    from safetensors.torch import load_file

    from mtnlg_lightning.checkpoint import read_model_state

    out = tmp_path / "model.safetensors"
    result = run_cli_tool("tools/consolidate_checkpoint.py", str(trained["dir"] / "step=3.ckpt"), str(out))
    assert result.returncode == 0 and "wrote" in result.stdout
    weights = load_file(out)
    state = read_model_state(trained["dir"] / "step=3.ckpt")
    assert sorted(weights) == sorted(state.weights) and "lm_head.weight" not in weights
    assert weights["embed.wte.weight"].shape == (state.config.vocab_size, state.config.hidden_size)
    assert all(torch.equal(weights[k], state.weights[k]) for k in weights)


def run_cli_tool(*args):
    import subprocess

    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------------------ bad input, CLI
def fit_from(ckpt_path, tmp_path, *extra):
    return run_cli(
        "fit",
        "--config",
        "configs/tiny.yaml",
        "--trainer.max_steps",
        "6",
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir",
        str(tmp_path / "logs"),
        "--ckpt_path",
        str(ckpt_path),
        *extra,
    )


def assert_one_line_exit_2(result, tmp_path, *fragments):
    errors = [line for line in result.stderr.splitlines() if line.startswith("mtnlg: error: ")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(errors) == 1 and all(f in errors[0] for f in fragments), result.stderr[-2000:]  # one rank says it
    assert not list((tmp_path / "logs").rglob("metrics.csv")) or not any(
        "train_loss" in line
        for p in (tmp_path / "logs").rglob("metrics.csv")
        for line in p.read_text().splitlines()[1:]
    )  # nothing trained


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "delete", "alter"])
def test_a_damaged_shard_fails_the_load_with_one_line_and_exit_2(trained, tmp_path, damage):
    copy = tmp_path / "step=3.ckpt"
    shutil.copytree(trained["dir"] / "step=3.ckpt", copy)
    damage_file(copy / "rank-00000.safetensors", damage)
    assert_one_line_exit_2(fit_from(copy, tmp_path), tmp_path, "rank-00000.safetensors")


@pytest.mark.slow
def test_bad_checkpoint_paths_and_shapes_are_one_line(trained, tmp_path):
    assert_one_line_exit_2(fit_from(tmp_path, tmp_path), tmp_path, "not a complete checkpoint")
    assert_one_line_exit_2(fit_from(tmp_path / "nothing.ckpt", tmp_path), tmp_path, "does not exist")
    other = fit_from(trained["dir"] / "step=3.ckpt", tmp_path, "--model.model_overrides", "{hidden_size: 32}")
    assert_one_line_exit_2(other, tmp_path, "blocks.0.attn.proj.bias", "another model shape")
    deeper = fit_from(trained["dir"] / "step=3.ckpt", tmp_path, "--model.model_overrides", "{num_layers: 3}")
    assert_one_line_exit_2(deeper, tmp_path, "blocks.2.", "another model shape")


@pytest.mark.slow
def test_a_layout_the_model_cannot_take_fails_before_loading(trained, tmp_path):
    result = fit_from(
        trained["dir"] / "step=3.ckpt",
        tmp_path,
        "--trainer.strategy",
        "configs/strategy/tp2.yaml",
        "--trainer.strategy.tensor_parallel",
        "3",
        "--trainer.devices",
        "3",
    )
    assert_one_line_exit_2(result, tmp_path, "heads")
