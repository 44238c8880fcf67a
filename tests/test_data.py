"""Indexed dataset files, packing with EOD, blending, tokenizer, DP-sharded step batches, bad files."""

import json
import os
from itertools import pairwise

import numpy as np
import pytest

from mtnlg_lightning.data.datamodule import StepBatches
from mtnlg_lightning.data.gpt_dataset import BlendedDataset, GPTDataset, split_ranges
from mtnlg_lightning.data.indexed import IndexedDataset, IndexedDatasetWriter
from mtnlg_lightning.data.tokenizer import Tokenizer, train_bpe
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.train.lr_batch_schedules import BatchSizeSchedule

EOD = 0


def write_docs(prefix, docs, dtype=np.uint16):
    writer = IndexedDatasetWriter(prefix, dtype)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()
    return IndexedDataset(prefix)


def numbered_docs(count, rng):
    """Document d holds tokens d*1000+1 .. d*1000+n then EOD, so every token names its document and position."""
    return [[d * 1000 + i + 1 for i in range(int(rng.integers(3, 40)))] + [EOD] for d in range(count)]


def test_indexed_dataset_round_trips_documents(tmp_path):
    docs = numbered_docs(50, np.random.default_rng(0))
    dataset = write_docs(tmp_path / "d", docs)
    assert len(dataset) == 50 and dataset.num_tokens == sum(map(len, docs))
    for i, doc in enumerate(docs):
        assert dataset[i].tolist() == doc
    assert not list(tmp_path.glob("*.tmp"))


def test_index_file_is_megatron_mmidIdx_format(tmp_path):
    write_docs(tmp_path / "d", [[1, 2, 3], [4, 5]])
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert np.frombuffer(raw, dtype=np.int32, count=2, offset=34).tolist() == [3, 2]


def test_missing_bin_is_a_clear_error(tmp_path):
    write_docs(tmp_path / "d", [[1, 2, 3]])
    os.remove(tmp_path / "d.bin")
    with pytest.raises(MTNLGError, match=r"missing dataset file .*d\.bin \(write it with mtnlg-preprocess\)"):
        IndexedDataset(tmp_path / "d")


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_truncated_files_are_clear_errors(tmp_path, suffix):
    write_docs(tmp_path / "d", [[1, 2, 3], [4, 5, 6, 7]])
    path = tmp_path / f"d{suffix}"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(MTNLGError, match="truncated or corrupt"):
        IndexedDataset(tmp_path / "d")


def test_samples_pack_documents_across_eod_boundaries(tmp_path):
    docs = numbered_docs(30, np.random.default_rng(1))
    dataset = write_docs(tmp_path / "d", docs)
    stream = np.concatenate(docs)
    samples = GPTDataset(dataset, (0, 30), seq_len=16, num_samples=10, seed=3)
    seen_eod_inside = False
    for i in range(len(samples)):
        sample = samples[i]
        assert len(sample) == 17
        # every window is a contiguous run of some epoch's document order: each token follows its predecessor
        # within a document, or an EOD starts the next document
        for a, b in pairwise(sample):
            assert (b == a + 1 and a != EOD) or a == EOD or b == EOD
        seen_eod_inside |= bool((sample[1:-1] == EOD).any())
    assert seen_eod_inside
    assert len(samples) == (len(stream) - 1) // 16


def test_shuffling_is_deterministic_from_the_seed_and_longer_runs_extend_shorter_ones(tmp_path):
    dataset = write_docs(tmp_path / "d", numbered_docs(40, np.random.default_rng(2)))
    a = GPTDataset(dataset, (0, 40), 16, num_samples=20, seed=5)
    b = GPTDataset(dataset, (0, 40), 16, num_samples=20, seed=5)
    longer = GPTDataset(dataset, (0, 40), 16, num_samples=5 * len(a), seed=5)
    other = GPTDataset(dataset, (0, 40), 16, num_samples=20, seed=6)
    assert all(np.array_equal(a[i], b[i]) and np.array_equal(a[i], longer[i]) for i in range(len(a)))
    assert longer.num_epochs > 1
    assert not all(np.array_equal(a[i], other[i]) for i in range(len(a)))


def test_split_assigns_disjoint_document_ranges():
    assert split_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    with pytest.raises(MTNLGError, match="comma-separated"):
        split_ranges(10, "a,b")


class Constant:
    def __init__(self, value, size):
        self.value, self.size = value, size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return (self.value, i)


def test_blend_proportions_match_weights_within_one_percent_over_10k_samples():
    weights = [14.3, 19.3, 5.7, 2.9, 4.8, 0.9, 1.0, 0.2, 9.4, 1.4, 1.6, 13.0, 15.7, 9.0, 0.9]  # MT-NLG
    n = 10_000
    sizes = BlendedDataset.samples_needed(weights, n)
    blend = BlendedDataset([Constant(i, s) for i, s in enumerate(sizes)], weights, n)
    counts = np.bincount([blend[i][0] for i in range(n)], minlength=len(weights))
    share = np.asarray(weights) / sum(weights)
    assert np.all(np.abs(counts / n - share) < 0.01)
    # exact accounting: every prefix is within one sample of its quota
    for prefix in (7, 100, 1234, n):
        c = np.bincount(blend.dataset_index[:prefix], minlength=len(weights))
        assert np.all(np.abs(c - share * prefix) <= 1.0)
    # each dataset's samples are consumed in order, none twice
    for d in range(len(weights)):
        picked = blend.sample_index[blend.dataset_index == d]
        assert picked.tolist() == list(range(len(picked)))


def test_step_batches_shard_the_global_batch_by_data_parallel_rank_and_follow_the_ramp():
    dataset = [np.array([i, i]) for i in range(1000)]
    ramp = BatchSizeSchedule(8, 4, 4, 12)  # 4,4,4 then 8,...
    shards = [list(StepBatches(dataset, ramp.batch_size_at_samples, 0, 44, rank, 2)) for rank in range(2)]
    sizes = [int(b["global_batch_size"]) for b in shards[0]]
    assert sizes == [4, 4, 4, 8, 8, 8, 8]
    for step in range(len(sizes)):
        rows = np.concatenate([shards[r][step]["input_ids"][:, 0].numpy() for r in range(2)])
        start = int(shards[0][step]["consumed_samples"])
        assert rows.tolist() == list(range(start, start + sizes[step]))
    resumed = list(StepBatches(dataset, ramp.batch_size_at_samples, 12, 44, 1, 2))
    assert [int(b["consumed_samples"]) for b in resumed] == [12, 20, 28, 36]


def test_a_batch_carries_inputs_labels_shifted_by_one_and_positions():
    """The shift from inputs to targets happens once, in the data: labels[t] = the token after input_ids[t]."""
    windows = [np.arange(10 * i, 10 * i + 6) for i in range(4)]  # seq_len 5: windows of 6 tokens
    batch = next(iter(StepBatches(windows, lambda _: 4, 0, 4, 0, 1)))
    assert batch["input_ids"].tolist() == [list(range(10 * i, 10 * i + 5)) for i in range(4)]
    assert batch["labels"].tolist() == [list(range(10 * i + 1, 10 * i + 6)) for i in range(4)]
    assert batch["position_ids"].tolist() == [list(range(5))] * 4


def test_tokenizer_trained_here_round_trips_text_and_has_an_eod(tmp_path):
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Über naïve café — 東京 ✓",
        "x = [i ** 2 for i in range(10)]",
    ]
    tokenizer = train_bpe(texts * 20, vocab_size=300, output=tmp_path)
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eod_id is not None
    assert Tokenizer(tmp_path / "tokenizer.json").encode(texts[0]) == tokenizer.encode(texts[0])


def test_tokenizer_loads_gpt2_style_vocab_and_merges(tmp_path):
    tokenizer = train_bpe(["hello world, hello there"] * 10, vocab_size=280, output=tmp_path)
    model = json.loads((tmp_path / "tokenizer.json").read_text())["model"]
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    (tmp_path / "gpt2" / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    loaded = Tokenizer(tmp_path / "gpt2")
    assert loaded.encode("hello world") == tokenizer.encode("hello world")
    assert loaded.decode(loaded.encode("hello there")) == "hello there"


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(MTNLGError, match="no tokenizer at"):
        Tokenizer(tmp_path / "nothing")


def test_builtin_demo_corpus_is_real_text_and_tokenized(demo_data):
    prefix, tokenizer_path = demo_data
    dataset, tokenizer = IndexedDataset(prefix), Tokenizer(tokenizer_path)
    assert len(dataset) > 300 and dataset.num_tokens > 300_000
    text = tokenizer.decode(dataset[0][:-1])
    assert dataset[0][-1] == tokenizer.eod_id
    assert sum(word in text.lower() for word in (" the ", " of ", " is ", " a ")) >= 3
