"""Padding only where the layout needs it, and the numbers a user reads.

Unpacked fine-tuning rows (`--data.pack false`: one example per row) come from the data padded to seq_len, with
their lengths (ROW_LENGTHS). A layout that may change shapes computes each micro-batch only up to its longest row,
rounded up to a multiple of 8 (and of sequence and context parallelism's cuts); a pipeline's schedule runs fixed
shapes, so there the rows keep seq_len and the log says so once. The cut changes no loss and no gradient, in any
layout. `tokens_per_sec` counts the documents' tokens, `padding_share` the padding's share of the positions
computed, and TFLOP/s and MFU the model FLOPs of the positions computed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from test_finetune_data import example, tiny_chat_run

from mtnlg_lightning.config import get_config
from mtnlg_lightning.data.packing import GROUP_LENGTHS, PADDING_DOCUMENT, ROW_LENGTHS, ROW_MULTIPLE, Rows, rows_batch
from mtnlg_lightning.data.preferences import pair_rows, pairs_batch
from mtnlg_lightning.demo.synthetic.instructions import write_instructions
from mtnlg_lightning.dpo_loss import DPOConfig, PairRewards
from mtnlg_lightning.grpo_loss import GRPOConfig
from mtnlg_lightning.loss import IGNORE_INDEX, StepLoss, counted_labels, cross_entropy
from mtnlg_lightning.model import build_model
from mtnlg_lightning.parallel.config import ParallelConfig
from mtnlg_lightning.train.flops import flops_per_iteration, head_flops_per_token
from mtnlg_lightning.train.objectives.grpo import GRPO
from mtnlg_lightning.train.objectives.preference import PreferenceLoss, SequenceScores, with_row_index
from mtnlg_lightning.train.objectives.rollouts import ROW_TOKENS, completion_rows, shared_prompt_rows
from mtnlg_lightning.train.step_interfaces import RowWidths, accumulate, micro_batch_shapes, micro_batches_of
from testing.lightning_run import quiet_trainer
from testing.parallel_harness import PADDED_SEQ_LEN, PadRows, assert_trains_like, launch_runs, tiny_run, trained

HERE = Path(__file__).resolve().parent


def unpacked_batch(lengths, seq_len: int = 256) -> dict[str, torch.Tensor]:
    rows = Rows.one_per_row([example(n, first=3) for n in lengths], seq_len, pad_id=0)
    return rows_batch([rows[i] for i in range(len(rows))])


def test_unpacked_rows_are_grouped_longest_first_and_each_micro_batch_computed_up_to_its_longest_rounded_up_to_8():
    batch = unpacked_batch([10, 70, 3, 20, 200, 1])
    assert batch[ROW_LENGTHS].tolist() == [10, 70, 3, 20, 200, 1]
    assert ROW_MULTIPLE == 8
    micro_batches = list(micro_batches_of(batch, 2, row_multiple=ROW_MULTIPLE))
    assert [input_ids.shape for input_ids, _, _ in micro_batches] == [(2, 200), (2, 24), (2, 8)]
    for (input_ids, labels, inputs), rows in zip(micro_batches, ([4, 1], [3, 0], [2, 5]), strict=True):
        width = input_ids.shape[1]  # the rows' first `width` positions, every field alike
        assert torch.equal(input_ids, batch["input_ids"][rows, :width])
        assert torch.equal(labels, batch["labels"][rows, :width])
        assert torch.equal(inputs["document_ids"], batch["document_ids"][rows, :width])
        assert torch.equal(inputs["position_ids"], batch["position_ids"][rows, :width])
    assert micro_batch_shapes(batch, 2, 8) == [(2, 200), (2, 24), (2, 8)]
    # a pipeline's fixed shapes (no multiple), and rows that do not give their lengths, keep seq_len and their order
    assert micro_batch_shapes(batch, 2, None) == [(2, 256)] * 3
    unsaid = {k: v for k, v in batch.items() if k != ROW_LENGTHS}
    assert micro_batch_shapes(unsaid, 2, 8) == [(2, 256)] * 3
    kept = [input_ids for input_ids, _, _ in micro_batches_of(batch, 2, None)]
    assert torch.equal(torch.cat(kept), batch["input_ids"])


def test_cutting_the_padding_leaves_every_loss_and_gradient():
    """The cut positions are padding after each row's example: attention is causal within a document and their
    labels are ignored, and the step's loss is the token mean over every micro-batch's labels, so the tiny model's
    losses and gradients are those of the rows computed whole, in their order (fp32)."""
    torch.manual_seed(0)
    model = build_model(get_config("tiny", seq_len=256, max_position_embeddings=256))
    batch = unpacked_batch([10, 70, 3, 20, 120, 1])
    batch["input_ids"] = batch["input_ids"] % 4000 + 1  # the example ids, within the vocabulary

    def step(row_multiple):
        model.zero_grad()
        step_loss = StepLoss(cross_entropy, 3, 1, counted_labels(batch["labels"]))  # the step's token mean
        loss = accumulate(model, torch.Tensor.backward, batch, 2, step_loss, row_multiple=row_multiple)
        return loss, {name: p.grad.clone() for name, p in model.named_parameters()}

    (cut, cut_grads), (whole, whole_grads) = step(ROW_MULTIPLE), step(None)
    torch.testing.assert_close(cut, whole, rtol=1e-6, atol=0)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(cut_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_layout_cuts_rows_to_a_multiple_of_its_sequence_cuts_where_shapes_may_change_and_says_once_where_not(
    caplog,
):
    """One process: multiples of 8; SP and CP: of 8 and their cuts; a pipeline's fixed shapes and a mixture of
    experts (whose router losses count the padding too) keep seq_len, and the log says why, once."""
    dense, moe = get_config("tiny"), get_config("tiny-llama", family="mixtral", num_experts=4, experts_per_token=2)
    assert moe.moe and not dense.moe
    assert RowWidths().multiple(dense) == 8
    sp_cp = ParallelConfig(tensor_parallel=2, sequence_parallel=True, context_parallel=3).sequence_multiple
    assert RowWidths().multiple(dense, sequence_multiple=sp_cp) == 24  # 8 and 2 x CP x TP = 12 both divide it
    assert RowWidths().multiple(dense, pipeline=True) is None and RowWidths().multiple(moe) is None
    batch = unpacked_batch([10, 20])
    said = []
    for config, pipeline in ((dense, True), (moe, False), (dense, False)):
        widths = RowWidths()
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                widths.note(batch, config, pipeline)
        said.append([r.getMessage() for r in caplog.records if "seq_len" in r.getMessage()])
        caplog.clear()
    tail = ": each row is padded to seq_len 256, not to its micro-batch's longest row (pack the data to spend fewer "
    assert said == [
        ["pipeline parallelism runs fixed shapes" + tail + "positions on padding)"],
        ["a mixture of experts routes the padding too (its router losses count every position)" + tail
         + "positions on padding)"],
        [],
    ]  # fmt: skip


def preference_batch(pair_lengths, seq_len: int = 256) -> dict[str, torch.Tensor]:
    """Pairs of a chosen and a rejected example of the given lengths, as the preference data serves them."""
    pairs = [(example(c, first=3), example(r, first=5)) for c, r in pair_lengths]
    batch = pairs_batch([pair_rows(pair, seq_len, pad_id=0) for pair in pairs])
    batch["input_ids"] = batch["input_ids"] % 4000 + 1
    return batch


def test_preference_pairs_are_cut_to_their_micro_batchs_longest_row_staying_whole_and_in_order():
    """DPO's rows are padded to seq_len by the data, with their lengths: a micro-batch of pairs is computed up to its
    longest row (rounded up to 8), the pairs grouped longest first but each pair's chosen row right before its
    rejected one, and the targets' last column (the row's index, past the inputs) kept."""
    batch = preference_batch([(10, 70), (3, 5), (120, 20), (9, 40)])
    assert batch[ROW_LENGTHS].tolist() == [10, 70, 3, 5, 120, 20, 9, 40]
    assert batch[GROUP_LENGTHS].tolist() == [70, 70, 5, 5, 120, 120, 40, 40]
    targeted = {**batch, "labels": with_row_index(batch["labels"])}
    micro_batches = list(micro_batches_of(targeted, 4, row_multiple=ROW_MULTIPLE))
    assert [(input_ids.shape, labels.shape) for input_ids, labels, _ in micro_batches] == [
        ((4, 120), (4, 121)),
        ((4, 40), (4, 41)),
    ]
    assert [labels[:, -1].tolist() for _, labels, _ in micro_batches] == [[4, 5, 0, 1], [6, 7, 2, 3]]
    for input_ids, labels, _ in micro_batches:
        rows, width = labels[:, -1], input_ids.shape[1]
        assert torch.equal(input_ids, batch["input_ids"][rows, :width])
        assert torch.equal(labels[:, :-1], batch["labels"][rows, :width])


def test_cutting_preference_pairs_leaves_the_dpo_loss_its_gradients_and_the_rewards():
    torch.manual_seed(0)
    model = build_model(get_config("tiny", seq_len=256, max_position_embeddings=256))
    batch = preference_batch([(10, 70), (3, 5), (120, 20), (9, 40)])
    targeted = {**batch, "labels": with_row_index(batch["labels"])}
    reference = torch.randn(len(batch["labels"])) * 3

    def step(row_multiple):
        model.zero_grad()
        rewards = PairRewards(4, torch.device("cpu"))
        loss_fn = PreferenceLoss(DPOConfig(beta=0.5), SequenceScores(), reference, rewards)
        loss = accumulate(model, torch.Tensor.backward, targeted, 4, loss_fn, row_multiple=row_multiple)
        return loss, {name: p.grad.clone() for name, p in model.named_parameters()}, rewards.chosen.clone()

    (cut, cut_grads, cut_rewards), (whole, whole_grads, whole_rewards) = step(ROW_MULTIPLE), step(None)
    torch.testing.assert_close(cut, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(cut_rewards, whole_rewards, rtol=1e-6, atol=1e-7)
    for name, grad in whole_grads.items():  # summed log-probs: gradients up to ~3, so 1e-6 is fp32 rounding here
        torch.testing.assert_close(cut_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_grpo_counts_a_completion_rows_tokens_not_its_padding():
    """A row per completion (under a pipeline, or share_prompts off): tokens_per_sec counts each row's prompt and
    completion, not the padding after them (shared rows mark theirs by document)."""
    rows = completion_rows([[5, 6, 7], [8]], [[9, 10], []], seq_len=6, pad_id=0)
    assert rows[ROW_TOKENS].tolist() == [5, 1]
    assert GRPO(GRPOConfig(), None).document_tokens(rows) == 6
    shared = shared_prompt_rows([[5, 6, 7]], [[9, 10], [11]], width=8, pad_id=0, longest=2)
    assert GRPO(GRPOConfig(), None).document_tokens(shared) == 2 + 2 + 1


# ---------------------------------------------------------------------------------------------- the layouts
LAYOUTS = ["dp2", "tp2_sp", "cp2", "pp2"]


@pytest.fixture(scope="module")
def padded_runs(tmp_path_factory):
    """Each layout's run (one launch) and one process's, which cuts micro-batches of 4 rows to their longest."""
    names = [f"padded_{layout}" for layout in LAYOUTS]
    runs = launch_runs(HERE / "dist_label_runs.py", tmp_path_factory.mktemp("padding"), names)
    rec, _ = tiny_run(callbacks=[PadRows()], seq_len=PADDED_SEQ_LEN)
    return runs | {"one process": trained(rec)}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_cut_to_their_longest_train_alike_in_every_layout(layout, padded_runs):
    """dp2 with accumulation (each rank's micro-batches of 2 rows cut to their own widths), tp2 with sequence
    parallelism, cp2 (the cut width divides into 2 x CP chunks) and pp2 (fixed shapes: rows of seq_len) reproduce one
    process cutting micro-batches of 4: losses (fp32, rel 1e-6), gradient norms, parameters after 5 steps."""
    assert_trains_like(padded_runs[f"padded_{layout}"], padded_runs["one process"])


# ---------------------------------------------------------------------------------------------- the numbers
class StepNumbers(L.Callback):
    """Each step's logged tokens_per_sec, padding_share and tflops_per_device, and what its batch holds: examples
    (documents), their tokens, and the model FLOPs of its micro-batches as the runner cuts them (the LM head's only
    at the counted labels)."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        documents = batch["document_ids"]
        shapes = micro_batch_shapes(batch, pl_module.micro_batch_size, ROW_MULTIPLE)
        self.steps.append(
            {
                "tokens_per_sec": float(metrics["tokens_per_sec"]),
                "padding_share": float(metrics["padding_share"]),
                "tflops": float(metrics["tflops_per_device"]),
                "examples": int((documents.max(dim=1).values + 1).sum()),
                "tokens": int((documents != PADDING_DOCUMENT).sum()),
                "positions": sum(rows * width for rows, width in shapes),
                "flops": sum(flops_per_iteration(pl_module.config, rows, width) for rows, width in shapes)
                - 3 * head_flops_per_token(pl_module.config) * uncounted(shapes, batch["labels"]),
            }
        )


def uncounted(shapes: list[tuple[int, int]], labels: torch.Tensor) -> int:
    """The positions computed without a counted label: the LM head does not run there."""
    return sum(rows * width for rows, width in shapes) - int((labels != IGNORE_INDEX).sum())


def fine_tune(tmp_path: Path, train: Path, pack: bool) -> list[dict]:
    """One pass over `train` (a row a step, so no row is served twice), the tiny model on rows of 256."""
    module, data = tiny_chat_run(tmp_path, train, 256, pack, global_batch_size=1, micro_batch_size=1)
    numbers = StepNumbers()
    trainer = quiet_trainer(max_epochs=1, accelerator="cpu", devices=1, callbacks=[numbers], default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    return numbers.steps


def test_tokens_per_sec_counts_the_documents_tokens_so_packed_and_unpacked_runs_rank_as_their_examples(
    tmp_path, capsys
):
    """One pass over the same 24 examples, packed (4 or 5 to a row of 256) and unpacked (one to a row, cut to a
    multiple of 8): each step's tokens_per_sec counts its examples' tokens and TFLOP/s its positions (their ratio is
    the tokens per model FLOP, whatever the step took), padding_share is the rest of the positions, and the run's
    summary line says them. So the two runs' tokens per second rank as their examples per second (each step's
    seconds read back from its FLOPs and TFLOP/s): the same examples' tokens in each run."""
    train = write_instructions(tmp_path / "train.jsonl", count=24)
    runs = {}
    for pack in (True, False):
        runs[pack] = steps = fine_tune(tmp_path / str(pack), train, pack)
        for step in steps:
            assert step["tokens_per_sec"] / (step["tflops"] * 1e12) == pytest.approx(
                step["tokens"] / step["flops"], rel=1e-6
            )
            assert step["padding_share"] == pytest.approx(1 - step["tokens"] / step["positions"], rel=1e-6)
        summary = capsys.readouterr().out
        assert "tokens/s, padding " in summary and "positions computed" in summary and "TFLOP/s per device" in summary
    per_second = {}
    for pack, steps in runs.items():
        seconds = [step["flops"] / (step["tflops"] * 1e12) for step in steps]
        tokens = sum(step["tokens_per_sec"] * s for step, s in zip(steps, seconds, strict=True))
        per_second[pack] = (tokens / sum(seconds), sum(step["examples"] for step in steps) / sum(seconds))
    assert sum(s["examples"] for s in runs[True]) == sum(s["examples"] for s in runs[False]) == 24
    (packed_tokens, packed_examples), (unpacked_tokens, unpacked_examples) = per_second[True], per_second[False]
    assert (packed_tokens > unpacked_tokens) == (packed_examples > unpacked_examples)
    assert packed_tokens / unpacked_tokens == pytest.approx(packed_examples / unpacked_examples, rel=1e-6)
    assert np.mean([s["padding_share"] for s in runs[False]]) > np.mean([s["padding_share"] for s in runs[True]])
