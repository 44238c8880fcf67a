"""`DownstreamEval`: a downstream task's metrics logged during training (e.g. `lambada_acc`, `lambada_ppl`).

    trainer:
      callbacks:
        - class_path: mtnlg_lightning.evaluation.callback.DownstreamEval
          init_args: {task: lambada, data: data/demo_cloze.jsonl, tokenizer: TOKENIZER, every_n_steps: 100}

Under any layout the full weights are gathered (TP shards, pipeline stages, ZeRO-3 partitions), rank 0 scores the
task with a plain single-process GPT, and broadcasts the numbers, so every rank logs the same values.
"""

from __future__ import annotations

import lightning as L
import torch

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.evaluation import tasks
from mtnlg_lightning.evaluation.scoring import Scorer


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
        if task not in tasks.TASKS:
            raise MTNLGError(f"unknown task {task!r}; the known tasks are {', '.join(tasks.TASKS)}")
        if not data or not tokenizer:
            raise MTNLGError("DownstreamEval needs data (the task file) and tokenizer")
        self.task, self.data, self.tokenizer_path = task, data, tokenizer
        self.every_n_steps, self.shots, self.fewshot_data = every_n_steps, list(shots or [0]), fewshot_data
        self.limit, self.batch_size, self.seed = limit, batch_size, seed
        self.last: dict[str, float] = {}

    def setup(self, trainer, pl_module, stage: str) -> None:
        from mtnlg_lightning.data.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(self.tokenizer_path)  # bad paths fail at start-up, not at the first evaluation

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps and step != trainer.max_steps:
            return
        weights = self._full_weights(trainer, pl_module)  # collective: every rank takes part
        metrics = self._evaluate(pl_module, weights) if trainer.is_global_zero else None
        metrics = trainer.strategy.broadcast(metrics, src=0)
        self.last = metrics
        for name, value in metrics.items():
            pl_module.log(name, value, rank_zero_only=False)

    @staticmethod
    def _full_weights(trainer, pl_module) -> dict[str, torch.Tensor]:
        from mtnlg_lightning.strategy import MegatronDeepSpeedStrategy

        if isinstance(trainer.strategy, MegatronDeepSpeedStrategy):
            from mtnlg_lightning.parallel.gathered import full_state_dict

            weights = full_state_dict(trainer.strategy)
        else:  # one process, or DDP: every rank holds the whole model
            weights = {k: v.detach() for k, v in pl_module.model.named_parameters()}
        return {k: v for k, v in weights.items() if k != "lm_head.weight"}

    @torch.no_grad()
    def _evaluate(self, pl_module, weights) -> dict[str, float]:
        from mtnlg_lightning.evaluation.data import read_records
        from mtnlg_lightning.interop.gpt2_mapping import load_model_space
        from mtnlg_lightning.model import build_model

        model = build_model(pl_module.config)
        load_model_space(model, {k: v.float().cpu() for k, v in weights.items()})
        model = model.to(pl_module.device).eval()
        scorer = Scorer(model, self.batch_size)
        if self.task == "perplexity":
            from mtnlg_lightning.evaluation.data import read_documents

            found = tasks.perplexity(scorer, self.tokenizer, read_documents(self.data)[: self.limit])
            return {"perplexity_loss": found["loss"], "perplexity_ppl": found["perplexity"]}
        fields = ("text",) if self.task == "lambada" else ("sentence1", "sentence2", "gold_label")
        records = read_records(self.data, fields)[: self.limit]
        fewshot = read_records(self.fewshot_data, fields) if self.fewshot_data else None
        out = {}
        for k in self.shots:
            suffix = f"_{k}shot" if k else ""
            if self.task == "lambada":
                pool = [r["text"] for r in fewshot] if fewshot else None
                found = tasks.lambada(scorer, self.tokenizer, [r["text"] for r in records], k, pool, self.seed)
                out |= {f"lambada_acc{suffix}": found["acc"], f"lambada_ppl{suffix}": found["perplexity"]}
            else:
                found = tasks.hans(scorer, self.tokenizer, records, k, fewshot, self.seed)
                out |= {f"hans_{name}{suffix}": v for name, v in found.items() if name.startswith("acc")}
        return out
