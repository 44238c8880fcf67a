"""Packed rows with document masks: attention never crosses a document boundary.

A row packing several documents carries `document_ids` (tokens of one document share an id), `position_ids`
restarting at each document and no label across a boundary; the model then scores each document exactly as if it
were alone: the packed row's summed token losses are the sum of the documents' own (and without the mask they are
not), its logits are transformers' Llama on each document alone, FlexAttention (forward, on CPU) gives the dense
mask's numbers, context parallelism's ring masks each block exactly, and every layout trains packed rows as one
process does.
"""

from __future__ import annotations

import queue
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_models import random_family_dir

from mtnlg_lightning.config import get_config
from mtnlg_lightning.data.datamodule import StepBatches, language_modelling_batch, positions_within_documents
from mtnlg_lightning.data.gpt_dataset import GPTDataset
from mtnlg_lightning.data.indexed import IndexedDataset, IndexedDatasetWriter
from mtnlg_lightning.inference.load import load_model
from mtnlg_lightning.loss import IGNORE_INDEX
from mtnlg_lightning.model import DocumentMask, branch_document, build_model
from mtnlg_lightning.parallel.context_parallel import Ring, RingAttentionCore, split_sequence
from testing.parallel_harness import PackDocuments, assert_trains_like, launch_runs, pack_documents, tiny_run, trained

HERE = Path(__file__).resolve().parent
LENGTHS = [11, 20, 17]  # the documents of the packed row
MODELS = {  # MT-NLG's block (learned positions, multi-head) and Llama's (RoPE, grouped-query attention)
    "gpt": get_config("tiny"),
    "llama": get_config("demo-llama", num_layers=2, hidden_size=64, ffn_hidden_size=128),
}


def packed_row(lengths=LENGTHS, vocab: int = 1000, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row of documents of `lengths` random tokens: input_ids, document_ids, position_ids and labels (each
    token's successor within its document; a document's last token has none)."""
    tokens = torch.randint(0, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    document_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = tokens[:, 1:].masked_fill(document_ids[:, 1:] != document_ids[:, :-1], IGNORE_INDEX)
    return {
        "input_ids": tokens,
        "document_ids": document_ids,
        "position_ids": positions_within_documents(document_ids),
        "labels": labels,
    }


def _inputs(row: dict) -> dict[str, torch.Tensor]:
    return {"position_ids": row["position_ids"], "document_ids": row["document_ids"]}


def summed_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def documents_of(row: dict) -> list[torch.Tensor]:
    return list(row["input_ids"].split(LENGTHS, dim=1))


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    torch.manual_seed(0)
    return build_model(MODELS[request.param]).eval()


# ---------------------------------------------------------------------------------------------- one process
@torch.no_grad()
def test_a_packed_row_loses_what_its_documents_lose_alone(model):
    """Summed per-token losses (the token mean's numerator: the counts are equal by construction), fp32, 1e-5."""
    row = packed_row()
    packed = summed_token_losses(model(row["input_ids"], **_inputs(row)), row["labels"])
    alone = sum(summed_token_losses(model(doc)[:, :-1], doc[:, 1:]) for doc in documents_of(row))
    assert int((row["labels"] != IGNORE_INDEX).sum()) == sum(n - 1 for n in LENGTHS)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=0)


@torch.no_grad()
def test_without_the_mask_the_documents_see_each_other(model):
    """The negative control: the same row, positions still restarting, attention left causal over the whole row."""
    row = packed_row()
    unmasked = summed_token_losses(model(row["input_ids"], position_ids=row["position_ids"]), row["labels"])
    alone = sum(summed_token_losses(model(doc)[:, :-1], doc[:, 1:]) for doc in documents_of(row))
    with pytest.raises(AssertionError):  # the comparison above fails (the random models: 2e-4 and more apart)
        torch.testing.assert_close(unmasked, alone, rtol=1e-5, atol=0)


def test_without_document_ids_the_forward_is_todays_bit_for_bit(model):
    row = packed_row()
    with torch.no_grad():
        assert torch.equal(model(row["input_ids"]), model(row["input_ids"], document_ids=None))


def test_the_gradients_of_a_packed_row_are_the_sum_of_its_documents(model):
    row = packed_row()
    model.zero_grad()
    summed_token_losses(model(row["input_ids"], **_inputs(row)), row["labels"]).backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    sum(summed_token_losses(model(doc)[:, :-1], doc[:, 1:]) for doc in documents_of(row)).backward()
    for name, p in model.named_parameters():
        # fp32 noise of a summed (not averaged) loss grows with the gradient's scale (up to ~7 here): the absolute
        # tolerance is 1e-6 of the tensor's largest entry (AVX2 and AVX-512 kernels round differently)
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-4, atol=1e-6 * max(scale, 1.0), msg=name)
    model.zero_grad()


@torch.no_grad()
def test_flex_attention_gives_the_dense_masks_logits(model, monkeypatch):
    """FlexAttention (the CUDA path) run eagerly on CPU: forward only, torch 2.13 has no CPU backward for it."""
    row = packed_row()
    dense = model(row["input_ids"], **_inputs(row))
    monkeypatch.setattr(model, "document_mask_kernel", "flex")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        flex = model(row["input_ids"], **_inputs(row))
    assert DocumentMask(row["document_ids"], "flex").block_mask is not None
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-5)


def branched_row(prefix: int = 9, branches=(5, 7, 4), vocab: int = 1000) -> tuple:
    """(tokens [1, S], document_ids, position_ids, [prefix + branch j alone, for each j]): a prefix document, then
    branches continuing it (GRPO's shared-prompt rows), each at the positions after the prefix."""
    tokens = torch.randint(0, vocab, (1, prefix + sum(branches)), generator=torch.Generator().manual_seed(1))
    ids = [0] * prefix + [branch_document(0, j) for j, n in enumerate(branches) for _ in range(n)]
    positions = list(range(prefix)) + [prefix + t for n in branches for t in range(n)]
    starts = [prefix + sum(branches[:j]) for j in range(len(branches))]
    alone = [
        torch.cat([tokens[:, :prefix], tokens[:, s : s + n]], dim=1) for s, n in zip(starts, branches, strict=True)
    ]
    return tokens, torch.tensor([ids]), torch.tensor([positions]), alone


@torch.no_grad()
def test_a_branch_sees_its_prefix_and_itself_not_its_siblings(model, monkeypatch):
    tokens, document_ids, position_ids, alone = branched_row()
    logits = model(tokens, position_ids=position_ids, document_ids=document_ids)
    at = 9
    for row in alone:  # each branch's logits are those of the prefix and the branch as a row of their own
        n = row.shape[1] - 9
        torch.testing.assert_close(logits[:, at : at + n], model(row)[:, 9:], rtol=0, atol=1e-5)
        at += n
    torch.testing.assert_close(logits[:, :9], model(alone[0])[:, :9], rtol=0, atol=1e-5)
    monkeypatch.setattr(model, "document_mask_kernel", "flex")  # FlexAttention's mask function says the same
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        flex = model(tokens, position_ids=position_ids, document_ids=document_ids)
    torch.testing.assert_close(flex, logits, rtol=0, atol=1e-5)
    # the negative control: the same tokens as one plain document see their siblings
    plain = model(tokens, position_ids=position_ids, document_ids=torch.zeros_like(document_ids))
    assert (plain[:, 14:] - logits[:, 14:]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return random_family_dir(tmp_path_factory.mktemp("llama"), "llama")


@torch.no_grad()
def test_packed_logits_equal_transformers_llama_on_each_document_alone(llama_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ours, _ = load_model(llama_dir)
    row = packed_row(vocab=4096)
    packed = ours(row["input_ids"], **_inputs(row))[..., :4096]
    expected = torch.cat([hf(doc).logits for doc in documents_of(row)], dim=1)
    assert (packed - expected).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------- the CP ring
class QueueRing(Ring):
    """The ring's exchange through queues between threads (no process group): the ring's blocks, masks and merges
    run as they do under torchrun, on 2 or 3 ranks in one process."""

    def __init__(self, inboxes: list[queue.Queue], cp_rank: int):
        self.group, self.cp_rank, self.size, self.inboxes = None, cp_rank, len(inboxes), inboxes

    def shift(self, tensors):
        self.inboxes[(self.cp_rank + 1) % self.size].put([t.clone() for t in tensors])
        return [], self.inboxes[self.cp_rank].get(timeout=60)


def ring_attention(cp: int, q, k, v, grad, document_ids):
    """Each rank's (output, dq, dk, dv) of its chunks, the ring run on `cp` threads."""
    inboxes, results, errors = [queue.Queue() for _ in range(cp)], [None] * cp, []

    def rank(r: int) -> None:
        try:
            mine = [split_sequence(t, r, cp, dim=2).clone().requires_grad_() for t in (q, k, v)]
            mask = DocumentMask(document_ids, "blocks") if document_ids is not None else None
            out = RingAttentionCore(QueueRing(inboxes, r))(*mine, 0.0, mask)
            (out * split_sequence(grad, r, cp, dim=2)).sum().backward()
            results[r] = [out.detach(), *(t.grad for t in mine)]
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("cp", [2, 3])
def test_the_ring_masks_each_block_exactly(cp):
    """Query heads 4, key/value heads 2; documents that start inside chunks, span chunks and fill a chunk whole, and
    branches of a prefix (which see the prefix, not each other), so the ring meets blocks the plain kernel computes,
    blocks it skips and blocks the masked kernel computes. The output and the gradients of q, k, v equal the whole
    sequence's dense-mask attention (fp32)."""
    generator = torch.Generator().manual_seed(0)
    B, S, D = 3, 48, 8
    q, grad = torch.randn(B, 4, S, D, generator=generator), torch.randn(B, 4, S, D, generator=generator)
    k, v = torch.randn(B, 2, S, D, generator=generator), torch.randn(B, 2, S, D, generator=generator)
    branches = [branch_document(0, j) for j, n in enumerate((10, 13, 9)) for _ in range(n)]  # GRPO's shared prompt
    document_ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 12 + [3] * 22, [0] * 24 + [1] * 24, [0] * 16 + branches])
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = DocumentMask(document_ids, "sdpa").attend(*whole)
    (out * grad).sum().backward()
    expected = [out.detach(), *(t.grad for t in whole)]
    ranks = ring_attention(cp, q, k, v, grad, document_ids)
    for r, got in enumerate(ranks):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
            torch.testing.assert_close(a, split_sequence(b, r, cp, dim=2), rtol=0, atol=1e-5, msg=f"{name} rank {r}")
    unmasked = ring_attention(cp, q, k, v, grad, None)  # the negative control: the ring without the ids
    assert (unmasked[1][0] - split_sequence(expected[0], 1, cp, dim=2)).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------- the data
def test_a_window_of_the_document_stream_is_masked_as_llama_3_trains():
    windows = torch.arange(100, 109)[None]  # seq_len 8
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]])
    batch = language_modelling_batch(windows, documents)
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    # the last token of documents 0 and 1 does not predict the next document's first; the window's last label is
    # its own document's next token
    assert batch["labels"].tolist() == [[101, 102, IGNORE_INDEX, 104, 105, 106, IGNORE_INDEX, 108]]


def test_indexed_windows_know_their_documents(tmp_path):
    """GPTDataset.document_ids numbers a window's documents from 0 where the stream's documents start."""
    writer = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    rng = np.random.default_rng(0)
    docs = [[d * 100 + i + 1 for i in range(int(rng.integers(2, 12)))] + [0] for d in range(1, 40)]
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()
    samples = GPTDataset(IndexedDataset(tmp_path / "d"), (0, len(docs)), seq_len=16, num_samples=12, seed=1)
    crossed = 0
    for i in range(len(samples)):
        tokens, documents = samples[i], samples.document_ids(i)
        # each token names its document (d*100 + i, EOD 0 ends it): a new id exactly after each EOD
        expected = np.concatenate([[0], np.cumsum(tokens[:-1] == 0)])
        assert documents.tolist() == expected.tolist()
        crossed += int(documents[-1] > 0)
    assert crossed > len(samples) // 2
    batch = next(iter(StepBatches(samples, lambda _: 4, 0, 4, 0, 1, document_mask=True)))  # --data.document_mask
    windows = torch.from_numpy(np.stack([samples[i] for i in range(4)]))
    documents = torch.from_numpy(np.stack([samples.document_ids(i) for i in range(4)]))
    expected = language_modelling_batch(windows, documents)
    for name in ("input_ids", "labels", "position_ids", "document_ids"):
        assert torch.equal(batch[name], expected[name]), name


def test_pack_documents_helper_marks_every_boundary():
    """The callback the layouts train with: ids, positions and ignored labels agree on the boundaries."""
    labels = torch.arange(2 * 64).view(2, 64)
    packed = pack_documents(labels, [3, 4])
    document_ids = packed["document_ids"]
    boundary = document_ids[:, 1:] != document_ids[:, :-1]
    assert boundary.any(dim=1).all()
    assert torch.equal(packed["position_ids"], positions_within_documents(document_ids))
    assert torch.equal(packed["labels"][:, :-1] == IGNORE_INDEX, boundary)


# ---------------------------------------------------------------------------------------------- the layouts
LAYOUTS = ["tp2_sp", "pp2", "cp2", "dp2_zero1"]


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory):
    names = [f"packed_{layout}" for layout in LAYOUTS]
    return launch_runs(HERE / "dist_label_runs.py", tmp_path_factory.mktemp("document_mask"), names)


@pytest.fixture(scope="module")
def one_process_packed():
    rec, _ = tiny_run(callbacks=[PackDocuments()])  # micro-batches of 4 of the global 8: accumulation here too
    return trained(rec)


def test_the_step_path_masks_what_the_batch_packs(one_process_packed):
    """The layouts' reference masks: the same positions and labels without `document_ids` train otherwise."""
    unmasked, _ = tiny_run(callbacks=[PackDocuments(document_ids=False)])
    assert (torch.tensor(one_process_packed["losses"]) - torch.tensor(unmasked.losses)).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_rows_train_alike_in_every_layout(layout, packed_runs, one_process_packed):
    """tp2 with sequence parallelism (the gathered sequence's mask), pp2 (ids and positions reaching the second
    stage), cp2 (the ring's blocks masked) and dp2 with ZeRO-1 and accumulation reproduce one process: losses
    (fp32, rel 1e-6), pre-clip gradient norms, parameters after 5 clipped Adam steps (2e-5, as the layout tests)."""
    assert_trains_like(packed_runs[f"packed_{layout}"], one_process_packed)
