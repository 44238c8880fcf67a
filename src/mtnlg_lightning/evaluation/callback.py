"""`DownstreamEval`: a downstream task's metrics logged during training (e.g. `lambada_acc`, `lambada_ppl`).

    trainer:
      callbacks:
        - class_path: mtnlg_lightning.evaluation.callback.DownstreamEval
          init_args: {task: lambada, data: data/demo_cloze.jsonl, tokenizer: TOKENIZER, every_n_steps: 100}

The task is scored by the one scorer of `mtnlg-eval` (`inference.scoring.Scorer`). Under `MegatronDeepSpeedStrategy`
it runs in the training layout, on the live stage models (items dealt over the data-parallel replicas, micro-batches
through the stages, log-likelihoods vocab-parallel): no rank holds more than its training share of the weights, and
every rank gets the same numbers. In one process or under DDP (every rank holds the whole model) rank 0 scores the
model as the 1 x 1 x 1 layout and broadcasts the numbers.

Logged besides the task metrics: `downstream_eval_peak_memory_mib`, the evaluation's peak memory of the fullest
rank (the same reading as the step's `peak_memory_mib`, `peak_memory.StepPeakMemory`).
"""

from __future__ import annotations

from contextlib import nullcontext

import lightning as L
import torch

from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation import tasks
from mtnlg_lightning.heartbeat import heartbeat
from mtnlg_lightning.inference.scoring import Scorer
from mtnlg_lightning.inference.sharded_model import ShardedModel
from mtnlg_lightning.train.peak_memory import StepPeakMemory
from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy


class DownstreamEval(L.Callback):
    def __init__(
        self,
        task: str = "lambada",
        data: str | None = None,
        tokenizer: str | None = None,
        every_n_steps: int = 100,
        shots: list[int] | None = None,
        fewshot_data: str | None = None,
        limit: int | None = None,
        batch_size: int = 16,
        seed: int = 1234,
    ):
        """
        Args:
            task: lambada, hans or perplexity (see `mtnlg-eval --help` for the file formats).
            data: the task file.
            tokenizer: tokenizer.json or directory the model was trained with.
            every_n_steps: evaluate after every this many optimizer steps (and after the last one).
            shots: numbers of in-context examples (lambada, hans); metrics of k > 0 get a `_{k}shot` suffix.
            fewshot_data: draw in-context examples from this file instead of the other items of `data`.
            limit: score only the first `limit` items (keeps the evaluation cheap during training).
            batch_size: sequences per forward pass; seed: seed of the in-context example draw.
        """
        tasks.check_task(task)
        if not data or not tokenizer:
            raise MTNLGError("DownstreamEval needs data (the task file) and tokenizer")
        self.task, self.data, self.tokenizer_path = task, data, tokenizer
        self.every_n_steps, self.shots, self.fewshot_data = every_n_steps, list(shots or [0]), fewshot_data
        self.limit, self.batch_size, self.seed = limit, batch_size, seed
        self.last: dict[str, float] = {}
        self.peak_memory_bytes = 0  # this rank's peak memory during the last evaluation

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.tokenizer = Tokenizer(self.tokenizer_path)  # bad paths fail at start-up, not at the first evaluation

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps and step != trainer.max_steps:
            return
        # Minutes on a large model, in between steps: learned apart from the steps and validation batches.
        heartbeat("eval", "downstream")
        peak = StepPeakMemory(pl_module.device)
        peak.reset()
        if isinstance(trainer.strategy, MegatronDeepSpeedStrategy):
            metrics = self._evaluate_in_layout(trainer.strategy)  # collective: every rank takes part
        else:  # one process, or DDP: every rank holds the whole model
            metrics = (
                self._evaluate(Scorer(ShardedModel.whole(pl_module.model), self.batch_size), pl_module)
                if trainer.is_global_zero
                else None
            )
            metrics = trainer.strategy.broadcast(metrics, src=0)
        self.peak_memory_bytes = peak.read_bytes()
        self.last = metrics
        for name, value in metrics.items():
            pl_module.log(name, value, rank_zero_only=False)
        mib = torch.tensor(self.peak_memory_bytes / 2**20, device=pl_module.device)
        pl_module.log("downstream_eval_peak_memory_mib", mib, sync_dist=True, reduce_fx="max")

    def _evaluate_in_layout(self, strategy) -> dict[str, float]:
        model = ShardedModel.from_strategy(strategy)
        context = nullcontext()
        if strategy.engine is not None and strategy.zero_stage == 3:  # TP only: gather this rank's ZeRO-3 shard
            import deepspeed  # optional extra [deepspeed]: imported on use (a ZeRO-3 engine)

            params = [p for m in model.modules() for p in m.parameters()]
            context = deepspeed.zero.GatheredParameters(params)
        return self._evaluate(Scorer(model, self.batch_size), *model.modules(), context=context)

    @torch.no_grad()
    def _evaluate(self, scorer, *modules, context=None) -> dict[str, float]:
        """The task's metrics with `modules` in eval mode (dropout off), their training mode restored after."""
        modes = [m.training for m in modules]
        for m in modules:
            m.eval()
        try:
            with context or nullcontext():
                return self._score(scorer)
        finally:
            for m, mode in zip(modules, modes, strict=True):
                m.train(mode)

    def _score(self, scorer) -> dict[str, float]:
        found = tasks.run_task(
            self.task, scorer, self.tokenizer, self.data, self.shots, self.fewshot_data, self.seed, self.limit
        )
        return tasks.logged_metrics(self.task, found)
