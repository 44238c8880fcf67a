"""A checkpoint (or a Hugging Face directory) is checked before it is believed: file names confined to the folder
and listed with size and hash, pieces tiling each tensor exactly once, shapes against the model configuration,
types, Lightning's paths in meta.pt -- each problem one line -- and a seeded fuzz of the reader."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import xxhash

from mtnlg_lightning.checkpoint.format import MANIFEST, META, CheckpointError, open_verified, read_meta
from mtnlg_lightning.checkpoint.model_state import read_model_state
from mtnlg_lightning.errors import MTNLGError
from testing import checkpoint_fuzzing


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("trust")
    originals = checkpoint_fuzzing.make_checkpoint(root / "pristine", root / "outside.safetensors")
    return root / "pristine", originals


@pytest.fixture
def ckpt(pristine, tmp_path):
    folder = tmp_path / "runs" / "step=3.ckpt"
    shutil.copytree(pristine[0], folder)
    shutil.copy(pristine[0].parent / "outside.safetensors", tmp_path / "outside.safetensors")
    return folder


def edit_manifest(folder: Path, change) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    change(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def list_file(manifest: dict, folder: Path, name: str) -> None:
    data = (folder / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "xxh64": xxhash.xxh64(data).hexdigest()}


def first_piece(manifest: dict, key: str = "model/blocks.0.attn.qkv.weight") -> dict:
    return manifest["tensors"][key]["pieces"][0]


def refused(folder: Path, match: str) -> str:
    with pytest.raises(CheckpointError, match=match) as caught:
        open_verified(folder)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_the_pristine_checkpoint_loads_exactly(ckpt, pristine):
    loaded = checkpoint_fuzzing.load_everything(ckpt)
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in pristine[1].items())
    assert read_model_state(ckpt).tokenizer == ckpt / "tokenizer.json"


def test_a_piece_path_out_of_the_folder_is_refused_even_when_listed_with_its_true_hash(ckpt):
    def point_outside(manifest):
        first_piece(manifest)["file"] = "../../outside.safetensors"
        manifest["files"]["../../outside.safetensors"] = {"size": 1, "xxh64": "0" * 16}

    edit_manifest(ckpt, point_outside)
    refused(ckpt, "not a plain file name inside the folder")


def test_a_piece_in_an_unlisted_file_is_refused(ckpt):
    edit_manifest(ckpt, lambda m: first_piece(m).update(file="rank-00009.safetensors"))
    refused(ckpt, "not among the listed files")


def test_a_listed_file_that_is_a_link_out_of_the_folder_is_refused(ckpt):
    (ckpt / "rank-00000.safetensors").unlink()
    (ckpt / "rank-00000.safetensors").symlink_to(ckpt.parent.parent / "outside.safetensors")
    refused(ckpt, "symbolic link")


def test_overlapping_pieces_are_refused_not_counted_twice(ckpt):
    """Before: the overlap counted twice toward coverage, so the hole it left loaded as zeros."""

    def overlap(manifest):
        pieces = manifest["tensors"]["model/blocks.0.attn.qkv.weight"]["pieces"]
        pieces[1]["offsets"][0] -= 1  # the second row box starts one row early (and ends one early: a hole)

    edit_manifest(ckpt, overlap)
    refused(ckpt, "overlap")


def test_a_gap_in_flat_fragments_is_refused(ckpt):
    edit_manifest(ckpt, lambda m: m["tensors"]["optim/blocks.0.mlp.fc1.weight/exp_avg"]["pieces"].pop())
    refused(ckpt, "a gap")


def test_shapes_disagreeing_with_the_model_config_are_refused_before_any_allocation(ckpt, monkeypatch):
    """A manifest may claim any size; the model configuration decides, checked before a tensor exists."""

    def huge(manifest):
        entry = manifest["tensors"]["model/blocks.0.mlp.fc1.bias"]
        entry["shape"] = [2**40]
        entry["pieces"] = [{"file": "rank-00000.safetensors", "offsets": [0], "shape": [2**40]}]

    edit_manifest(ckpt, huge)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: pytest.fail("allocated before the check"))
    refused(ckpt, "fc1.bias")


def test_a_config_claiming_more_layers_than_the_manifest_holds_is_refused_before_building(ckpt):
    edit_manifest(ckpt, lambda m: m["model_config"].update(num_layers=10**9))
    refused(ckpt, "1000000000 layers")


def test_a_config_too_large_to_build_even_on_the_meta_device_is_one_line(ckpt):
    """Found by the fuzzer (seed 1, case 9560): a position table of 2**62 rows overflows torch's size check."""
    edit_manifest(ckpt, lambda m: m["model_config"].update(seq_len=2**62))
    refused(ckpt, "cannot be built")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda m: m.update(version="1"), "version"),
        (lambda m: m.update(files=[]), "'files'"),
        (lambda m: m["files"]["meta.pt"].update(size="12"), "size"),
        (lambda m: m["tensors"]["model/norm.weight"].update(dtype="load"), "dtype"),
        (lambda m: first_piece(m).update(offsets=[0, "0"]), "offsets"),
        (lambda m: m["model_config"].update(hidden_size=0), "hidden_size"),
        (lambda m: m["model_config"].update(bogus=1), "unknown field"),
        (lambda m: m["model_config"].pop("num_heads"), "no num_heads"),
        (lambda m: m.update(global_step=-1), "global_step"),
    ],
)
def test_manifest_fields_of_the_wrong_type_are_one_line(ckpt, change, match):
    edit_manifest(ckpt, change)
    refused(ckpt, match)


def test_the_tokenizer_is_used_only_when_listed_and_hashed(ckpt):
    (ckpt / "tokenizer.json").write_text('{"altered": true}')
    refused(ckpt, "tokenizer.json")
    edit_manifest(ckpt, lambda m: m["files"].pop("tokenizer.json"))
    assert read_model_state(ckpt).tokenizer is None  # present but unlisted: not used


def test_a_safetensors_header_disagreeing_with_the_manifest_is_refused_even_when_rehashed(ckpt):
    import struct

    name = "rank-00001.safetensors"
    data = (ckpt / name).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    key = "model/blocks.0.attn.qkv.weight"
    header[key]["shape"] = header[key]["shape"][::-1]
    raw = json.dumps(header).encode()
    (ckpt / name).write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
    edit_manifest(ckpt, lambda m: list_file(m, ckpt, name))
    refused(ckpt, "the manifest says bfloat16")


def test_lightning_paths_outside_the_checkpoints_folder_are_not_restored(ckpt):
    """Lightning deletes earlier top-k and last checkpoints by the paths in its callback state: a meta.pt naming
    files elsewhere (a copied run, or a hostile file) must not make it delete them."""
    victim = str(ckpt.parent.parent / "precious")
    state = {
        "dirpath": str(ckpt.parent),
        "best_model_path": victim,
        "best_k_models": {victim: 1.0, str(ckpt.parent / "step=2.ckpt"): 2.0},
        "kth_best_model_path": victim,
        "last_model_path": str(ckpt.parent / "step=2.ckpt"),
    }
    torch.save({"callbacks": {"ModelCheckpoint{}": state}}, ckpt / META)
    edit_manifest(ckpt, lambda m: list_file(m, ckpt, META))
    manifest = json.loads((ckpt / MANIFEST).read_text())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = read_meta(ckpt, manifest)["callbacks"]["ModelCheckpoint{}"]
    assert any("not restored" in str(w.message) for w in caught)
    assert restored["best_model_path"] == "" and "best_k_models" not in restored
    assert "kth_best_model_path" not in restored and "last_model_path" not in restored
    # Paths inside the folder that holds the checkpoint are kept as Lightning wrote them.
    inside = {"dirpath": str(ckpt.parent), "best_model_path": str(ckpt), "best_k_models": {str(ckpt): 1.0}}
    torch.save({"callbacks": {"ModelCheckpoint{}": inside}}, ckpt / META)
    edit_manifest(ckpt, lambda m: list_file(m, ckpt, META))
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert read_meta(ckpt, manifest)["callbacks"]["ModelCheckpoint{}"]["best_k_models"] == {str(ckpt): 1.0}


def test_meta_pt_not_listed_in_the_manifest_is_not_read(ckpt):
    edit_manifest(ckpt, lambda m: m["files"].pop(META))
    with pytest.raises(CheckpointError, match="does not list meta.pt"):
        read_model_state(ckpt)


# ------------------------------------------------------------------------------------------------ Hugging Face
@pytest.fixture
def hf_dir(tmp_path):
    """A GPT-2 directory (config.json + safetensors) written without transformers, from a random tiny model."""
    from safetensors.torch import save_file

    from mtnlg_lightning.config import ModelConfig
    from mtnlg_lightning.interop.gpt2_mapping import tensor_pairs
    from mtnlg_lightning.model import build_model

    config = ModelConfig(**checkpoint_fuzzing.CONFIG)
    weights = {k: v.detach() for k, v in build_model(config).named_parameters() if k != "lm_head.weight"}
    weights["embed.wte.weight"] = weights["embed.wte.weight"][: config.vocab_size]
    folder = tmp_path / "gpt2"
    folder.mkdir()
    gpt2 = {p.theirs: p.to_hf(weights[p.ours], config.num_heads) for p in tensor_pairs(config.num_layers)}
    save_file(gpt2, str(folder / "model.safetensors"))
    cfg = {"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "n_positions": 4, "vocab_size": 12}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_hf_directory_reads(hf_dir):
    from mtnlg_lightning.interop.hf import read_hf_dir

    assert read_hf_dir(hf_dir).config.num_layers == 1


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda c: c.pop("n_embd"), "has no 'n_embd'"),
        (lambda c: c.update(n_head="2"), "n_head is '2'"),
        (lambda c: c.update(n_inner=-4), "n_inner is -4"),
        (lambda c: c.update(resid_pdrop=2), "resid_pdrop"),
        (lambda c: c.update(vocab_size=13), "config.json implies"),
    ],
)
def test_hf_config_keys_are_checked_one_line_each(hf_dir, change, match):
    from mtnlg_lightning.interop.hf import read_hf_dir

    cfg = json.loads((hf_dir / "config.json").read_text())
    change(cfg)
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MTNLGError, match=match):
        read_hf_dir(hf_dir)


def test_hf_shard_names_are_confined_to_the_directory(hf_dir, tmp_path):
    from mtnlg_lightning.interop.hf import read_hf_dir

    shutil.move(hf_dir / "model.safetensors", tmp_path / "elsewhere.safetensors")
    index = {"metadata": {}, "weight_map": {"wte.weight": "../elsewhere.safetensors"}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MTNLGError, match=r"shard .*\.\./elsewhere.safetensors.* not a file inside"):
        read_hf_dir(hf_dir)


# ------------------------------------------------------------------------------------------------ fuzz
def test_fuzzed_checkpoints_load_exactly_or_fail_with_one_line(tmp_path):
    """300 seeded mutations (the full run: python benchmarks/fuzz_checkpoint.py --cases 5000)."""
    result = checkpoint_fuzzing.run(300, seed=26, workdir=tmp_path)
    assert not result["failures"], result["failures"][:3]
    assert result["loaded"] > 0 and result["refused"] > 200  # both outcomes are exercised
