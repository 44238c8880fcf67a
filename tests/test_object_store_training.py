"""Training data from S3 (moto's server on 127.0.0.1): an indexed dataset named by a URL is read by ranged requests
through a bounded cache of blocks, gives the sequences of the local files, and trains to the same losses."""

import csv
import pickle

import numpy as np
import pytest
from conftest import run_cli

from mtnlg_lightning.corpora.block_cache import BlockCache, RemoteArray
from mtnlg_lightning.data.indexed import IndexedDataset


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTNLG_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def demo_on_s3(s3, demo_data):
    """The built-in corpus's PREFIX.bin/.idx and tokenizer uploaded to a bucket: (local prefix, URL prefix)."""
    prefix, tokenizer = demo_data
    bucket = s3.new_bucket()
    for suffix in (".bin", ".idx"):
        s3.put(f"s3://{bucket}/data/demo{suffix}", open(f"{prefix}{suffix}", "rb").read())
    s3.put(f"s3://{bucket}/tok/tokenizer.json", open(tokenizer, "rb").read())
    return prefix, f"s3://{bucket}/data/demo", f"s3://{bucket}/tok"


def test_random_reads_through_a_small_cache_are_the_file_and_the_bound_holds(s3, tmp_path):
    data = np.random.default_rng(0).integers(0, 50000, 300_000, dtype=np.uint16)  # 600 KB
    bucket = s3.new_bucket()
    s3.put(f"s3://{bucket}/tokens.bin", data.tobytes())
    cache = BlockCache(str(tmp_path / "blocks"), max_bytes=160 << 10, block_bytes=32 << 10)  # 5 blocks of 19
    tokens = RemoteArray(f"s3://{bucket}/tokens.bin", np.uint16, cache)
    assert len(tokens) == len(data)
    rng = np.random.default_rng(1)
    largest = 0
    for _ in range(300):
        start = int(rng.integers(0, len(data)))
        stop = min(len(data), start + int(rng.integers(1, 40_000)))  # up to 5 blocks at once
        assert np.array_equal(tokens[start:stop], data[start:stop])
        largest = max(largest, cache.size_on_disk())
    assert largest <= cache.max_bytes  # after every read, whatever it read
    assert largest >= cache.max_bytes - cache.block_bytes  # the cache was used up to its bound, and evicted
    assert not pickle.loads(pickle.dumps(cache))._recent  # a loader worker starts with no blocks in memory


def test_a_changed_object_is_read_again_not_served_from_the_cache(s3, tmp_path):
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/tokens.bin"
    cache = BlockCache(str(tmp_path / "blocks"), max_bytes=1 << 20, block_bytes=1 << 10)
    s3.put(url, np.arange(4096, dtype=np.int32).tobytes())
    assert RemoteArray(url, np.int32, cache)[10:13].tolist() == [10, 11, 12]
    s3.put(url, (np.arange(4096, dtype=np.int32) * 2).tobytes())
    assert RemoteArray(url, np.int32, cache)[10:13].tolist() == [20, 22, 24]


def test_a_dataset_named_by_a_url_reads_the_sequences_of_the_local_files(demo_on_s3, tmp_path):
    local_prefix, url_prefix, _ = demo_on_s3
    local = IndexedDataset(local_prefix)
    cache = BlockCache(str(tmp_path / "blocks"), max_bytes=256 << 10, block_bytes=64 << 10)
    remote = IndexedDataset(url_prefix, cache)
    assert remote.remote and not local.remote and len(remote) == len(local) > 100
    assert np.array_equal(remote.doc_idx, local.doc_idx) and remote.dtype == local.dtype
    for i in list(range(len(local))) + list(np.random.default_rng(2).permutation(len(local))[:200]):
        assert np.array_equal(remote[i], local[i])
    assert cache.size_on_disk() <= cache.max_bytes


def train_losses(save_dir, *data_args) -> list[float]:
    """`mtnlg fit` of the tiny config for 5 steps on the given data; the train_loss of each step."""
    out = run_cli(
        "fit",
        "--config",
        "configs/tiny.yaml",
        "--trainer.max_steps",
        "5",
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir",
        str(save_dir),
        "--data.builtin_corpus",
        "null",
        *data_args,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (metrics,) = save_dir.rglob("metrics.csv")
    with open(metrics) as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


@pytest.mark.slow
def test_five_training_steps_from_s3_give_the_losses_of_local_disk(demo_on_s3, demo_data, tmp_path):
    local_prefix, url_prefix, url_tokenizer = demo_on_s3
    local = train_losses(tmp_path / "local", "--data.datasets", f"[{local_prefix}]", "--data.tokenizer", demo_data[1])
    blocks = tmp_path / "blocks"
    remote = train_losses(
        tmp_path / "s3",
        "--data.datasets",
        f"[{url_prefix}]",
        "--data.tokenizer",
        url_tokenizer,
        "--data.remote_cache_dir",
        str(blocks),
        "--data.remote_cache_mb",
        "1",
        "--data.remote_block_kb",
        "64",
    )
    assert len(local) == 5 and remote == local  # the same batches, so the same losses, step for step
    cached = sum(p.stat().st_size for p in blocks.glob("*.blk"))
    assert 0 < cached <= 1 << 20  # the run read through the cache, within its bound
