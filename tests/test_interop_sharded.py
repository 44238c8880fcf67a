"""Hugging Face's sharded safetensors layout, both ways, one tensor at a time: a checkpoint exported in shards loads in
transformers with our logits, `--model.init_from` of the shards trains, consolidation shards the same way, a bad index
is one line, and the export's resident memory stays a few shards above the import baseline."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import ROOT
from tiny_runs import tiny_checkpoint as trained_tiny_checkpoint

from mtnlg_lightning.checkpoint.consolidate import consolidate
from mtnlg_lightning.checkpoint.safetensors_shards import ShardedTensors, parse_size
from mtnlg_lightning.demo.builtin_corpus import build_demo_data
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.inference.load import load_model
from mtnlg_lightning.interop.export_cli import main as export_main
from mtnlg_lightning.train.module import MTNLGModule

transformers = pytest.importorskip("transformers")
SHARD = "300KB"  # the tiny model's fp32 weights are ~1.6 MB: the embedding alone and a few shards of blocks
SHARD_NAME = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return trained_tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def sharded_export(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "tiny-hf"
    tokenizer = build_demo_data(progress=False)[1]
    assert export_main([str(tiny_checkpoint), str(out), "--tokenizer", tokenizer, "--max-shard-size", SHARD]) == 0
    return out


def test_sizes_read_as_hugging_face_reads_them():
    assert parse_size("100MB") == 100 * 10**6 and parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("123456") == 123456 and parse_size(" 1.5 kb ") == 1500
    with pytest.raises(MTNLGError, match="is not a size"):
        parse_size("5 parsecs")


def test_sharded_export_is_hugging_face_s_layout_and_loads_with_equal_logits(tiny_checkpoint, sharded_export):
    shards = sorted(p.name for p in sharded_export.glob("*.safetensors"))
    assert len(shards) >= 3 and not (sharded_export / "model.safetensors").exists()
    assert all(SHARD_NAME.fullmatch(name) and int(SHARD_NAME.fullmatch(name)[2]) == len(shards) for name in shards)
    index = json.loads((sharded_export / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    files = ShardedTensors(sharded_export)
    tensors = {name: files.read(name) for name in files.names}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    limit = parse_size(SHARD)
    for shard in shards:  # no shard over the limit, unless it holds a single tensor larger than the limit
        held = [t for name, t in tensors.items() if index["weight_map"][name] == shard]
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held) <= limit
    # The same tensors, bit for bit, as the export in one file.
    single = sharded_export.parent / "single"
    assert export_main([str(tiny_checkpoint), str(single), "--tokenizer", build_demo_data(progress=False)[1]]) == 0
    assert [p.name for p in single.glob("*.safetensors")] == ["model.safetensors"]
    one = ShardedTensors(single)
    assert one.names == files.names and all(torch.equal(one.read(n), tensors[n]) for n in one.names)
    # transformers reads the index and the shards; its logits are ours.
    tokens = torch.randint(0, 4096, (3, 64), generator=torch.Generator().manual_seed(0))
    model, _ = load_model(tiny_checkpoint)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(sharded_export).eval()
    with torch.no_grad():
        ours, theirs = model(tokens)[..., :4096], hf_model(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_init_from_the_sharded_directory_starts_training_from_its_weights(sharded_export):
    """`--model.init_from DIR` as `mtnlg fit` runs it (tiny recipe, in this process): the first step's loss is the
    loss transformers computes with the shards on that batch, and training goes on from there."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from mtnlg_lightning.data.datamodule import GPTDataModule

    class FirstBatchAndLosses(Callback):
        def __init__(self):
            self.first, self.losses = None, []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.first = {k: batch[k].clone() for k in ("input_ids", "labels")} if self.first is None else self.first

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(trainer.callback_metrics["train_loss"]))

    recipe = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    L.seed_everything(recipe["seed_everything"], verbose=False)
    module = MTNLGModule(**recipe["model"], init_from=str(sharded_export))
    seen = FirstBatchAndLosses()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="32-true", max_steps=3, logger=False, enable_checkpointing=False,
        callbacks=[seen], limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module, GPTDataModule(**recipe["data"]))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(sharded_export).eval()
    with torch.no_grad():
        logits = hf_model(seen.first["input_ids"]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), seen.first["labels"].flatten()).item()
    assert len(seen.losses) == 3 and seen.losses[0] == pytest.approx(expected, rel=1e-5)
    assert all(math.isfinite(loss) for loss in seen.losses)
    moved = module.model.blocks["0"].mlp.fc1.weight.detach() - hf_model.transformer.h[0].mlp.c_fc.weight.t()
    assert moved.abs().max().item() > 1e-4  # the optimizer stepped from the imported weights


def test_consolidation_streams_into_the_same_shards(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file

    single = consolidate(tiny_checkpoint, tmp_path / "one" / "model.safetensors")
    sharded = consolidate(tiny_checkpoint, tmp_path / "many" / "model.safetensors", max_shard_size=SHARD)
    assert single["files"] == ["model.safetensors"] and sharded["files"][-1] == "model.safetensors.index.json"
    assert len(sharded["files"]) >= 4 and sharded["parameters"] == single["parameters"]
    whole, files = load_file(tmp_path / "one" / "model.safetensors"), ShardedTensors(tmp_path / "many")
    assert files.names == sorted(whole) and all(torch.equal(files.read(n), whole[n]) for n in whole)
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == sorted(sharded["files"])  # no staging left


def _broken_copy(source, target, edit):
    import shutil

    shutil.copytree(source, target)
    index_path = target / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    edit(index, target)
    index_path.write_text(json.dumps(index))
    return target


def _rename_first_shard(index, directory):
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {k: ("../" + v if v == first else v) for k, v in index["weight_map"].items()}


def _delete_second_shard(index, directory):
    (directory / sorted(set(index["weight_map"].values()))[1]).unlink()


def _index_a_tensor_in_the_wrong_shard(index, directory):
    index["weight_map"]["transformer.h.0.ln_1.weight"] = index["weight_map"]["transformer.wte.weight"]


BROKEN = {
    "escapes": (_rename_first_shard, r"shard '\.\./model-00001-of-000\d\d\.safetensors' of \S+ is not a file inside"),
    "missing": (_delete_second_shard, r"names shard model-00002-of-000\d\d\.safetensors, which is missing from"),
    "absent": (
        _index_a_tensor_in_the_wrong_shard,
        r"places transformer\.h\.0\.ln_1\.weight in model-000\d\d-of-000\d\d\.safetensors, which holds no such",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_bad_index_is_one_line_before_any_weight_is_read(sharded_export, tmp_path, capsys, case):
    edit, message = BROKEN[case]
    broken = _broken_copy(sharded_export, tmp_path / "broken", edit)
    out = tmp_path / "out"
    assert export_main([str(broken), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(rf"mtnlg-export-hf: error: {re.escape(str(broken))}\S* {message}", err[0]), err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))  # nothing half-written
    with pytest.raises(MTNLGError, match=message):  # `mtnlg fit --model.init_from` stops as it parses its config
        MTNLGModule(preset="tiny", init_from=str(broken))


def test_shards_linked_from_elsewhere_read_as_the_hub_cache_links_them(sharded_export, tmp_path):
    """The Hub's cache holds a snapshot of links to blobs: a linked shard is still a file of the directory."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snapshot").mkdir()
    for file in sharded_export.iterdir():
        (tmp_path / "blobs" / file.name).write_bytes(file.read_bytes())
        (tmp_path / "snapshot" / file.name).symlink_to(f"../blobs/{file.name}")
    linked, original = ShardedTensors(tmp_path / "snapshot"), ShardedTensors(sharded_export)
    assert linked.names == original.names and all(torch.equal(linked.read(n), original.read(n)) for n in linked.names)


MEMORY_PROBE = """
import re, sys
from mtnlg_lightning.interop.export_cli import main
assert main(sys.argv[1:]) == 0
print("peak_rss_bytes", int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024)
"""


def export_peak_rss(*args: str) -> int:
    """Peak resident memory of `mtnlg-export-hf ARGS` in a fresh process (VmHWM: its own peak, pages of mapped
    files it touched included)."""
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(re.search(r"peak_rss_bytes (\d+)", out.stdout)[1])


@pytest.mark.slow
def test_export_memory_does_not_grow_with_the_model(tmp_path):
    """Checkpoints of 16 MB and 93 MB exported in 4 MB shards peak within 2 shards of each other: memory is a
    slice of a shard, not the model (benchmarks/bench_export.py measures a 355M-parameter model against the
    import baseline; reading the whole model first would add the 78 MB difference here)."""
    from testing.synthetic_checkpoint import write_synthetic_checkpoint

    small = write_synthetic_checkpoint(tmp_path / "small", num_layers=2, hidden_size=256, vocab_size=8192)
    big = write_synthetic_checkpoint(tmp_path / "big", num_layers=8, hidden_size=256, vocab_size=65536)
    sizes = [(c / "rank-00000.safetensors").stat().st_size for c in (small, big)]
    assert sizes[1] - sizes[0] > 75 * 10**6
    peaks = [export_peak_rss(str(c), str(tmp_path / f"{c.name}-hf"), "--max-shard-size", "4MB") for c in (small, big)]
    assert len(list((tmp_path / "big-hf").glob("model-*-of-*.safetensors"))) >= 8  # the 67 MB embedding: 1 shard
    assert abs(peaks[1] - peaks[0]) <= 2 * 4 * 10**6, (sizes, peaks)
