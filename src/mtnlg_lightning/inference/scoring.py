"""Scoring `Request`s in any layout (one process is 1 x 1 x 1), log-likelihoods and greedy checks vocab-parallel.

`Scorer.score(requests, desc)` is what `evaluation.tasks`, the harness adapter and `DownstreamEval` call. Requests
are sorted by length (similar lengths batch together) and batched, right-padded; the batches are
dealt over the data-parallel replicas, padded with dummy batches so every replica runs the same number; each batch
is cut into micro-batches that flow through the stages. The last stage turns its vocabulary slice of the logits
into per-token log-probabilities and argmax checks with a few [tokens]-sized all-reduces over TP (max, sum of
exponentials, target logit, first index of the maximum), never gathering the full-vocabulary logits; the padded
vocabulary rows take no part. The last stage's scores go to every rank of the replica, then to every replica.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from mtnlg_lightning.inference.requests import Request
from mtnlg_lightning.inference.sharded_model import ShardedModel


def vocab_parallel_token_scores(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_size: int, group):
    """(log p(target), target is the argmax) per row of `logits` [N, V_local], this rank's columns
    [vocab_start, vocab_start + V_local) of the vocabulary; columns >= vocab_size (padding) are ignored.
    `group`: the TP group (None: the logits hold the whole vocabulary)."""
    logits = logits.float()
    columns = torch.arange(vocab_start, vocab_start + logits.shape[-1], device=logits.device)
    logits = logits.masked_fill(columns >= vocab_size, float("-inf"))
    local_max, local_arg = logits.max(dim=-1)
    top = local_max.clone()
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sum_exp = (logits - top[:, None]).exp().sum(dim=-1)
    inside = (targets >= vocab_start) & (targets < vocab_start + logits.shape[-1])
    rows = torch.arange(logits.shape[0], device=logits.device)
    target_logit = logits[rows, (targets - vocab_start).clamp(0, logits.shape[-1] - 1)].masked_fill(~inside, 0.0)
    # The global argmax is the first column holding the maximum (as torch.argmax over the whole row).
    nowhere = torch.full_like(local_arg, torch.iinfo(torch.long).max)
    argmax = torch.where(local_max == top, local_arg + vocab_start, nowhere)
    if group is not None:
        dist.all_reduce(sum_exp, group=group)
        dist.all_reduce(target_logit, group=group)
        dist.all_reduce(argmax, op=dist.ReduceOp.MIN, group=group)
    logprob = target_logit - top - sum_exp.log()
    return logprob, argmax == targets


class Scorer:
    """Scores requests with a `ShardedModel` (or a whole model in this process); every rank returns every request's
    (sum of the targets' log-probabilities, greedy).

    split_over_dp: deal the batches over the data-parallel replicas (mtnlg-eval, DownstreamEval); False: this
    replica scores every request it is given (the harness adapter, whose evaluator already split them)."""

    def __init__(
        self,
        model: ShardedModel | torch.nn.Module,
        batch_size: int = 16,
        micro_batch_size: int | None = None,
        split_over_dp: bool = True,
        progress: bool = False,
    ):
        if not isinstance(model, ShardedModel):
            model = ShardedModel.whole(model)
        self.model, self.batch_size, self.split_over_dp = model, batch_size, split_over_dp
        pp = model.layout.pipeline_parallel
        self.micro_batch_size = micro_batch_size or max(1, -(-batch_size // pp))  # PP micro-batches per batch
        self.progress = progress and model.groups.rank == 0
        self.vocab = model.config.vocab_size
        self.max_len = model.config.max_position_embeddings

    @torch.inference_mode()
    def score(self, requests: list[Request], desc: str = "scoring") -> list[tuple[float, bool]]:
        layout, coord = self.model.layout, self.model.groups.coord
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].inputs))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        dp, dp_rank = (layout.data_parallel, coord.dp) if self.split_over_dp else (1, 0)
        batches += [[]] * (-len(batches) % dp)  # every replica runs the same number of batches
        mine = batches[dp_rank::dp]
        found: dict[int, tuple[float, bool]] = {}
        for batch in tqdm(mine, desc=desc, disable=not self.progress, leave=False):
            self._score_batch([requests[i] for i in batch], batch, found)
        return self._share(found, len(requests))

    def _score_batch(self, requests: list[Request], indices: list[int], found: dict) -> None:
        if not requests:  # a replica's padding batch: one token through every stage
            requests, indices = [Request([0], [0])], [-1]
        model = self.model
        width = model.padded_width(max(len(r.inputs) for r in requests))
        tokens = torch.zeros(len(requests), width, dtype=torch.long)
        for row, r in enumerate(requests):
            tokens[row, : len(r.inputs)] = torch.tensor(r.inputs)
        size = self.micro_batch_size
        micro = [tokens[i : i + size] for i in range(0, len(requests), size)]
        if model.layout.expert_parallel > 1:  # the replicas of an EP group pass as many micro-batches, in step
            micro += [torch.zeros(1, width, dtype=torch.long)] * (-(-self.batch_size // size) - len(micro))
        if not model.is_first:
            micro = [tuple(t.shape) for t in micro]
        group, tp_rank = model.tp_group, model.groups.coord.tp
        # Under context parallelism this rank's logits are those of its chunks: each target is scored by the rank
        # holding its position, and the sums are added up over the CP group.
        local = {int(p): i for i, p in enumerate(model.local_positions(width))}

        def on_output(m: int, logits: torch.Tensor) -> None:
            if m * size >= len(requests):  # a micro-batch that only keeps the EP group in step
                return
            rows, positions, targets, owners = [], [], [], []
            for row in range(logits.shape[0]):
                r = requests[m * size + row]
                end = len(r.inputs)
                for position, target in zip(range(end - len(r.targets), end), r.targets, strict=True):
                    if position in local:
                        rows.append(row)
                        positions.append(local[position])
                        targets.append(target)
                        owners.append(row)
            picked = logits[torch.tensor(rows, dtype=torch.long), torch.tensor(positions, dtype=torch.long)]
            target = torch.tensor(targets, dtype=torch.long, device=picked.device)
            logprob, greedy = vocab_parallel_token_scores(picked, target, tp_rank * logits.shape[-1], self.vocab, group)
            owner = torch.tensor(owners, dtype=torch.long, device=picked.device)
            totals = torch.zeros(logits.shape[0], dtype=torch.float64, device=picked.device)
            totals.index_add_(0, owner, logprob.double())
            misses = torch.zeros(logits.shape[0], dtype=torch.long, device=picked.device)
            misses.index_add_(0, owner, (~greedy).long())
            if model.layout.context_parallel > 1:
                dist.all_reduce(totals, group=model.groups.context_parallel_group)
                dist.all_reduce(misses, group=model.groups.context_parallel_group)
            for row, (total, miss) in enumerate(zip(totals.tolist(), misses.tolist(), strict=True)):
                index = indices[m * size + row]
                if index >= 0:
                    found[index] = (total, miss == 0)

        model.forward(micro, on_output)

    def _share(self, found: dict, count: int) -> list[tuple[float, bool]]:
        """The last stage's scores to every rank of its replica, then (split over DP) to every replica."""
        model = self.model
        groups = model.groups
        if model.layout.model_parallel > 1:
            source = model.layout.rank(model.holder[model.num_stages - 1], groups.coord.dp, 0, groups.coord.cp)
            box = [found if groups.rank == source else None]
            dist.broadcast_object_list(box, src=source, group=groups.model_parallel_group)
            found = box[0]
        if self.split_over_dp and model.layout.data_parallel > 1:
            parts = [None] * model.layout.data_parallel
            dist.all_gather_object(parts, found, group=groups.data_parallel_group)
            found = {k: v for part in parts for k, v in part.items()}
        return [found[i] for i in range(count)]
