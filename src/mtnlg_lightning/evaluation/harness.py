"""lm-evaluation-harness on a project checkpoint, without exporting: an `lm_eval.api.model.LM` over our model.

    results = run_harness(model, tokenizer, ["lambada_openai"], include_path=None)

Scores follow the harness' HF backend rules (see `scoring`), so they agree with `lm_eval --model hf` on the
exported model.

The model is an `inference.sharded_model.ShardedModel` in any layout (a whole model in this process is taken as the
1 x 1 x 1 one): the adapter's `rank` / `world_size` are the data-parallel ones, the evaluator deals the requests
over the replicas and gathers on the data-parallel group, and all TP / PP ranks of a replica score (and decode) each
request together through the pipeline (`inference.scoring.Scorer`, `inference.decode.generate_batch`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.extras import require_extra
from mtnlg_lightning.inference.decode import generate_batch
from mtnlg_lightning.inference.requests import encode_pair, pair_request, rolling_requests
from mtnlg_lightning.inference.scoring import Scorer
from mtnlg_lightning.inference.sharded_model import ShardedModel


def _lm_base():
    require_extra("eval", "the harness adapter")
    from lm_eval.api.model import LM  # optional extra [eval]: imported on use

    return LM


class _Adapter:
    """The methods the harness calls; mixed into its `LM` base class by `harness_lm` (lm-eval stays optional)."""

    def __init__(self, model, tokenizer, batch_size: int = 16, max_gen_toks: int = 256):
        super().__init__()
        if not isinstance(model, ShardedModel):
            model = ShardedModel.whole(model)
        if model.layout.expert_parallel > 1:  # mtnlg-eval's own tasks pad every replica to the same passes
            raise MTNLGError(
                f"expert_parallel {model.layout.expert_parallel}: lm-evaluation-harness deals its requests unevenly "
                "over the data-parallel ranks, and the ranks of an expert-parallel group must pass in step: run "
                "harness tasks with expert_parallel 1"
            )
        self.model, self.tokenizer, self.max_gen_toks = model, tokenizer, max_gen_toks
        self.scorer = Scorer(model, batch_size, split_over_dp=False, progress=True)
        self._rank, self._world_size = model.groups.coord.dp, model.layout.data_parallel
        self._device = model.device
        self.dp_group = model.groups.data_parallel_group

    # The evaluator's collectives run over the data-parallel group (unused with one replica).
    def all_gather(self, tensor):
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.dp_group)
        return torch.stack(parts)

    def gather_object(self, obj, dst: int = 0):
        parts = [None] * self._world_size
        dist.all_gather_object(parts, obj, group=self.dp_group)
        return parts if self._rank == dst else None

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier(group=self.dp_group)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        prepared = []
        for context, continuation in (r.args for r in requests):
            if context:
                ctx, cont = encode_pair(self.tokenizer, context, continuation)
            else:  # as the harness: an empty context is the end-of-text token
                ctx, cont = [self.tokenizer.eod_id], self.tokenizer.encode(continuation)
            prepared.append(pair_request(ctx, cont, self.scorer.max_len))
        return self.scorer.score(prepared, desc="loglikelihood")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        windows = [
            rolling_requests(self.tokenizer.encode(r.args[0]), self.tokenizer.eod_id, self.scorer.max_len)
            for r in requests
        ]
        scores = iter(self.scorer.score([w for ws in windows for w in ws], desc="loglikelihood_rolling"))
        return [sum(next(scores)[0] for _ in ws) for ws in windows]

    def generate_until(self, requests, disable_tqdm: bool = False):
        out = []
        limit = self.model.config.max_position_embeddings
        for context, kwargs in (r.args for r in requests):
            until = kwargs.get("until") or [self.tokenizer.decode([self.tokenizer.eod_id])]
            until = [until] if isinstance(until, str) else list(until)
            new = kwargs.get("max_gen_toks", self.max_gen_toks)
            ids = self.tokenizer.encode(context)[-max(1, limit - new) :] or [self.tokenizer.eod_id]
            # every rank of the replica decodes it together
            made = generate_batch(self.model, [ids], new, temperature=0, eos_id=self.tokenizer.eod_id).tokens[0]
            text = self.tokenizer.decode(made)
            cut = min((text.find(s) for s in until if s and s in text), default=len(text))
            out.append(text[:cut])
        return out


def harness_lm(model, tokenizer, batch_size: int = 16):
    cls = type("MTNLGLM", (_Adapter, _lm_base()), {})
    return cls(model, tokenizer, batch_size)


def task_manager(tasks: list[str], include_path: str | None = None):
    """The harness' `TaskManager` that knows `tasks` (one line naming the unknown ones)."""
    _lm_base()
    from lm_eval.tasks import TaskManager  # optional extra [eval]: imported on use

    manager = None
    if include_path:  # local tasks only: skip indexing the thousands of built-in task files (tens of seconds)
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if any(t not in manager.all_tasks for t in tasks):
            manager = None
    manager = manager or TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise MTNLGError(f"unknown harness task(s) {', '.join(unknown)} (add --include-path DIR for local tasks)")
    return manager


def run_harness(
    model, tokenizer, tasks: list[str], include_path: str | None = None, batch_size: int = 16, manager=None, **kw
):
    """`lm_eval.simple_evaluate` on our model (`kw`: its arguments, e.g. num_fewshot, limit); returns {task:
    {metric: value}} (the harness' `,none` filter suffix dropped); None on data-parallel ranks other than 0 of a
    layout. `manager`: a `task_manager` already built for these tasks."""
    lm = harness_lm(model, tokenizer, batch_size)
    from lm_eval import simple_evaluate  # optional extra [eval]: imported on use

    manager = manager or task_manager(tasks, include_path)
    evaluated = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, **kw)
    if evaluated is None:  # a data-parallel rank other than 0: the evaluator gathered its results to rank 0
        return None
    results = evaluated["results"]
    return {
        task: {k.split(",")[0]: v for k, v in metrics.items() if k != "alias" and "_stderr" not in k}
        for task, metrics in results.items()
    }
