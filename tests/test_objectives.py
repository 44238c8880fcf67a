"""The step is branchless: an objective (`train/objectives`) and the extensions (`train/extensions`) are objects the
module asks, so a new objective is one class and its line in `OBJECTIVES`, and the module, the strategy and the
checkpoint code name no objective or extension."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import lightning as L
import pytest

from mtnlg_lightning.data.datamodule import GPTDataModule
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.loss import StepLoss
from mtnlg_lightning.train.extensions import RouterBalancing, extensions_for
from mtnlg_lightning.train.module import MTNLGModule
from mtnlg_lightning.train.objectives import OBJECTIVES, LanguageModelling, build_objective

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "mtnlg_lightning"
TINY = {"preset": "tiny", "lr": 1e-3, "min_lr": 1e-4, "warmup_tokens": 1024, "decay_tokens": 10240}
# The centre of the house: the module, the strategy and the checkpoint code.
CENTRE = [
    PACKAGE / "train" / "module.py",
    PACKAGE / "train" / "strategy.py",
    *sorted((PACKAGE / "checkpoint").glob("*.py")),
]
# Lines naming an objective or an extension there: 113 before the objectives and extensions (f80b075), 38 after.
FEATURE_NAMES = re.compile(r"preference|lora|moe|WithRouterLosses|expert", re.IGNORECASE)
MOST_FEATURE_LINES = 38


class HalvedLanguageModelling(LanguageModelling):
    """An objective of a test's own: the language-modelling loss times one half."""

    name = "lm_halved"

    def step_loss(self, module, batch):
        return Halved(super().step_loss(module, batch))


class Halved:
    def __init__(self, step_loss: StepLoss):
        self.step_loss = step_loss

    def __call__(self, logits, labels):
        return 0.5 * self.step_loss(logits, labels)


def first_steps(objective: str, steps: int = 2) -> list[dict]:
    """(train_loss, grad_norm) of the first `steps` steps of the tiny recipe in one process, seed 1234."""
    records = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            metrics = trainer.callback_metrics
            records.append({name: float(metrics[name]) for name in ("train_loss", "grad_norm")})

    L.seed_everything(1234, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[Record()],
    )
    module = MTNLGModule(**TINY, micro_batch_size=4, global_batch_size=8, objective=objective, watchdog=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, GPTDataModule(builtin_corpus="python-docs", seed=1234))
    return records


def test_a_new_objective_is_one_class_and_its_line_in_the_registry(monkeypatch):
    monkeypatch.setitem(OBJECTIVES, HalvedLanguageModelling.name, HalvedLanguageModelling)
    plain, halved = first_steps("lm", 1), first_steps("lm_halved", 1)
    assert halved[0]["train_loss"] == pytest.approx(0.5 * plain[0]["train_loss"], rel=1e-6)
    assert halved[0]["grad_norm"] == pytest.approx(0.5 * plain[0]["grad_norm"], rel=1e-5)


def test_an_unknown_objective_is_one_line_naming_the_registered_ones():
    with pytest.raises(MTNLGError, match=r"^model\.objective must be one of lm, dpo, grpo, got 'ppo'$"):
        build_objective({"objective": "ppo"})


def test_the_data_must_serve_what_the_objective_trains_on():
    class Pairs:
        served = "pairs"
        objective_hint = "set model.objective dpo (or --config dpo)"

    with pytest.raises(MTNLGError, match=r"^model\.objective lm trains on sequences; the data serves pairs: set model"):
        build_objective({"objective": "lm"}).check_data(Pairs())
    settings = {"objective": "dpo", "dpo_beta": 0.1, "dpo_loss": "sigmoid", "dpo_label_smoothing": 0.0}
    with pytest.raises(MTNLGError, match=r"^model\.objective dpo trains on pairs; the data serves sequences: use"):
        build_objective(settings).check_data(GPTDataModule(builtin_corpus="python-docs"))


def test_the_extensions_come_from_the_model_and_the_config():
    assert extensions_for(MTNLGModule(preset="tiny-llama").config, {}) == []
    moe = MTNLGModule(
        preset="tiny-llama", model_overrides={"family": "mixtral", "num_experts": 4, "experts_per_token": 2}
    )
    assert [type(extension) for extension in moe.extensions] == [RouterBalancing]
    assert moe.loss_fn is moe.extensions[0].losses  # the router's losses wrap the token loss


def test_the_module_the_strategy_and_the_checkpoint_code_name_no_objective_or_extension():
    """The features live behind the objective and the extensions: what names them in the centre is the layout's
    expert-parallel dimension, the checkpoint format's adapter entries and the module's documented settings."""
    lines = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in CENTRE
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FEATURE_NAMES.search(line)
    ]
    assert len(lines) <= MOST_FEATURE_LINES, "\n".join(lines)
    for path in CENTRE:
        source = path.read_text()
        assert "isinstance(module.loss_fn" not in source and "objectives.preference" not in source, path
