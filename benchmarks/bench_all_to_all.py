#!/usr/bin/env python
"""Expert parallelism's all-to-all bytes per training step, measured, against the planner's formula.

    python benchmarks/bench_all_to_all.py [--ep 2 --micro-batch 8 --steps 3 --experts 8 --top-k 2]

EP ranks on this machine (gloo; one launch, `testing/local_ranks.py`), each a data-parallel rank holding E / EP of
every MoE layer's experts: the `demo_moe` model (the demo-llama block, 8 experts of width 256, top 2, dropless)
takes --steps forward + backward passes of --micro-batch sequences per rank. Measured: the rows every call to the
expert-parallel all-to-all hands the collective (`parallel/expert_parallel.py`), forward and, by the transposed
splits autograd sends back, backward; split into the rows a rank keeps and the rows that leave it, times h x the
element size. The formula (`planning.cost_model.all_to_all_bytes`, what `mtnlg-plan` times): per MoE layer and
micro-batch, 4 passes of tokens x k rows of h values, (EP-1)/EP of them off the rank (routed evenly). The rows in
all must equal the formula's exactly (every routed pair travels once each way); the off-rank share is the router's
balance. The planner counts bf16 values (2 bytes); this run is fp32 on CPU, so its bytes are scaled to bf16 for the
ratio."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the repository root: testing.*

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from results import benchmark_args, benchmark_parser, write_result  # noqa: E402

from mtnlg_lightning.config import get_config  # noqa: E402
from mtnlg_lightning.loss import cross_entropy  # noqa: E402
from mtnlg_lightning.model import build_model  # noqa: E402
from mtnlg_lightning.parallel import expert_parallel  # noqa: E402
from mtnlg_lightning.parallel.layout import ParallelLayout, ProcessGroups  # noqa: E402
from mtnlg_lightning.planning.cost_model import BF16, Layout, all_to_all_bytes  # noqa: E402
from testing.forked_ranks import MODEL_RANK  # noqa: E402
from testing.local_ranks import worker_rows, write_rows  # noqa: E402


def model_config(args):
    return get_config(
        "demo-llama", family="mixtral", num_experts=args.experts, experts_per_token=args.top_k, moe_ffn_hidden_size=256,
        norm_topk_prob=True,
    )  # fmt: skip


class RowCounter:
    """Wraps the all-to-all the dispatch calls: per call, the rows this rank keeps and those it sends away, forward
    (`input_split_sizes`) and backward (autograd sends the gradients by the transposed splits)."""

    def __init__(self, rank: int, collective):
        self.rank, self.collective = rank, collective
        self.kept = self.sent = 0

    def __call__(self, rows, output_split_sizes, input_split_sizes, group):
        for splits in (input_split_sizes, output_split_sizes):  # forward's send, backward's send
            self.kept += splits[self.rank]
            self.sent += sum(splits) - splits[self.rank]
        return self.collective(rows, output_split_sizes, input_split_sizes, group)


def worker(args) -> None:
    """One rank of the EP-rank launch; rank 0 writes the rows counted on all of them."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    config = model_config(args)
    torch.manual_seed(0)  # every rank builds the same weights, then keeps its run of the experts
    model = build_model(config)
    groups = ProcessGroups.create(ParallelLayout(args.ep, expert_parallel=args.ep))
    expert_parallel.apply_expert_parallel(model, groups)
    counter = RowCounter(groups.expert_place()[0], expert_parallel.all_to_all_autograd)
    expert_parallel.all_to_all_autograd = counter
    data = torch.Generator().manual_seed(1000 + dist.get_rank())  # each DP rank its own sequences
    for _ in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.micro_batch, config.seq_len + 1), generator=data)
        logits = model(tokens[:, :-1])
        cross_entropy(logits, tokens[:, 1:]).backward()
    element = next(model.parameters()).element_size()
    totals = torch.tensor([counter.kept, counter.sent], dtype=torch.float64)
    dist.all_reduce(totals)
    write_rows(args.worker, dict(kept_rows=totals[0].item(), sent_rows=totals[1].item(), element_size=element))


def main(argv=None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel ranks (= data-parallel ranks; default 2)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank and step (default 8)")
    parser.add_argument("--steps", type=int, default=3, help="forward + backward passes per rank (default 3)")
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer (default 8)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a rank of the launch: rank 0 writes its rows here
    args = benchmark_args(parser, argv)
    if args.worker:
        worker(args)
        return 0
    config = model_config(args)
    options = ["--ep", args.ep, "--micro-batch", args.micro_batch, "--steps", args.steps]
    options += ["--experts", args.experts, "--top-k", args.top_k]
    measured = worker_rows(args.ep, __file__, *options, what=f"ep={args.ep} ", preload=MODEL_RANK)
    per_rank_step = 1 / (args.ep * args.steps)
    to_bf16 = config.hidden_size * BF16 * per_rank_step
    moe_layers = len(config.moe_layers)
    formula_sent = moe_layers * all_to_all_bytes(config, Layout(1, 1, args.ep, ep=args.ep), args.micro_batch)
    formula_all = formula_sent * args.ep / (args.ep - 1)
    sent = measured["sent_rows"] * to_bf16
    moved = (measured["sent_rows"] + measured["kept_rows"]) * to_bf16
    result = {key: getattr(args, key) for key in ("ep", "micro_batch", "experts", "top_k")}
    result |= dict(seq_len=config.seq_len, moe_layers=moe_layers, rows_bytes_per_rank_step=moved)
    result |= dict(formula_rows_bytes=formula_all, off_rank_bytes_per_rank_step=sent)
    result |= dict(formula_off_rank_bytes=formula_sent, off_rank_ratio=sent / formula_sent)
    write_result(args.json, result)
    print(
        f"all-to-all per rank and step (ep{args.ep}, {args.micro_batch} x {config.seq_len} tokens, {moe_layers} MoE "
        f"layers, top {args.top_k} of {args.experts}; bf16 bytes):"
    )
    for what, measured_bytes, formula in (("every routed row, both ways", moved, formula_all),
                                          ("off the rank (the router's balance)", sent, formula_sent)):  # fmt: skip
        print(f"  {what:<36} measured {measured_bytes / 1e6:10.3f} MB   formula {formula / 1e6:10.3f} MB   "
              f"ratio {measured_bytes / formula:.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
