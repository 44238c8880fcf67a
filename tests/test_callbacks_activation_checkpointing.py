"""ActivationCheckpointing: each mode recomputes what it says, and losses and gradients match `none` (fp32)."""

from __future__ import annotations

import copy
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from mtnlg_lightning.callbacks import ActivationCheckpointing, apply_activation_checkpointing, checkpointed_modules
from mtnlg_lightning.config import get_config
from mtnlg_lightning.data.datamodule import GPTDataModule
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.model import AttentionCore, Block, build_model
from mtnlg_lightning.train.module import MTNLGModule, cross_entropy
from testing.lightning_run import TINY_RECIPE, quiet_trainer

# dropout on: the recomputation must replay the same masks (non-reentrant checkpoint restores the RNG state)
CONFIG = get_config("tiny", num_layers=4, hidden_dropout=0.1, attention_dropout=0.1)
EXPECTED = {
    "none": [],
    "full": ["blocks.0", "blocks.1", "blocks.2", "blocks.3"],
    "every_n": ["blocks.0", "blocks.2"],
    "selective": [f"blocks.{i}.attn.core" for i in range(4)],
}


def loss_and_grads(mode: str, counts: dict | None = None):
    torch.manual_seed(0)
    model = build_model(CONFIG)
    names = apply_activation_checkpointing(model, mode, every_n=2)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    if counts is not None:
        counts.clear()
    loss.backward()
    return names, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model


@pytest.fixture
def forward_counts(monkeypatch):
    """Counts class-forward calls made during backward (i.e. recomputations)."""
    counts: dict[str, int] = {}
    for cls in (Block, AttentionCore):
        original = cls.forward

        def counted(self, *args, _original=original, _name=cls.__name__, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", counted)
    return counts


@pytest.mark.parametrize("mode", ["full", "selective", "every_n"])
def test_mode_matches_none_and_recomputes_what_it_says(mode, forward_counts):
    _, ref_loss, ref_grads, ref_model = loss_and_grads("none", forward_counts)
    assert forward_counts == {}  # nothing recomputed without checkpointing
    names, loss, grads, model = loss_and_grads(mode, forward_counts)
    assert names == EXPECTED[mode]
    recomputed = {
        "full": {"Block": 4, "AttentionCore": 4},
        "every_n": {"Block": 2, "AttentionCore": 2},
        "selective": {"AttentionCore": 4},
    }[mode]
    assert forward_counts == recomputed
    torch.testing.assert_close(loss, ref_loss, rtol=1.3e-6, atol=1e-5)  # fp32 tolerance (identical in practice)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1.3e-6, atol=1e-5, msg=name)
    # the module tree and parameter names are untouched (state dicts, TP/PP swaps by name keep working)
    assert list(model.state_dict()) == list(ref_model.state_dict())
    assert all(type(m) is type(r) for m, r in zip(model.modules(), ref_model.modules(), strict=True))


def test_apply_is_idempotent_switchable_and_survives_deepcopy():
    model = build_model(CONFIG)
    apply_activation_checkpointing(model, "full")
    apply_activation_checkpointing(model, "full")
    assert checkpointed_modules(model) == EXPECTED["full"]
    apply_activation_checkpointing(model, "selective")  # re-applying another mode replaces the previous one
    assert checkpointed_modules(model) == EXPECTED["selective"]
    clone = copy.deepcopy(model)
    core = clone.blocks["0"].attn.core
    assert core.forward.args[0] is core  # the copy recomputes itself, not the original
    with torch.no_grad():  # no autograd: runs plainly
        clone(torch.zeros(1, 8, dtype=torch.long))
    apply_activation_checkpointing(model, "none")
    assert checkpointed_modules(model) == []
    with pytest.raises(MTNLGError):
        ActivationCheckpointing(mode="sometimes")


class Inspect(Callback):
    def on_fit_start(self, trainer, pl_module):  # after strategy.setup: the model was checkpointed before it
        self.names = checkpointed_modules(pl_module.model)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses = getattr(self, "losses", []) + [float(outputs["loss"])]


def _fit(callbacks):
    L.seed_everything(1234, verbose=False)
    trainer = quiet_trainer(accelerator="cpu", devices=1, max_steps=2, deterministic=True, callbacks=callbacks)
    module = MTNLGModule(
        **TINY_RECIPE, model_overrides={"hidden_dropout": 0.1}, micro_batch_size=4, global_batch_size=8
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, GPTDataModule(builtin_corpus="python-docs", seed=1234))
    return module


def test_callback_applies_at_configure_model_in_a_trainer_run():
    plain, checkpointed = Inspect(), Inspect()
    _fit([plain])
    callback = ActivationCheckpointing(mode="full")
    _fit([callback, checkpointed])
    assert callback.applied == ["blocks.0", "blocks.1"] == checkpointed.names and plain.names == []
    assert checkpointed.losses == pytest.approx(plain.losses, rel=1e-6, abs=1e-6)
