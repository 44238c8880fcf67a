"""LossSpikeDetection: detection at the right step, `skip` bit-identical, `rewind` + recorded skips (also after a
restart), NaN handling, no false positives on a normal run. In-process Trainer runs of the tiny preset (CPU)."""

from __future__ import annotations

import json
import math
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from mtnlg_lightning.callbacks import LossSpikeDetection, LossSpikeError, SpikeDetector
from mtnlg_lightning.data.datamodule import GPTDataModule
from mtnlg_lightning.train.module import MTNLGModule
from testing.lightning_run import TINY_RECIPE, quiet_trainer

BATCH = 8  # global batch of the tiny recipe: step s covers samples [8s, 8s + 8)


class PoisonedModule(MTNLGModule):
    """The tiny recipe; the loss of the batches starting at the given consumed_samples is scaled (or NaN)."""

    def __init__(self, poison: dict[int, float] | None = None):
        super().__init__(**TINY_RECIPE, micro_batch_size=4, global_batch_size=BATCH, grad_clip=1.0)
        self.poison = dict(poison or {})
        self.factor = None

    def layout_loss(self, loss_fn):
        """The layout's loss (the LM head inside it), scaled at the poisoned batches."""
        loss_fn = super().layout_loss(loss_fn)

        def poisoned(output, labels):
            loss = loss_fn(output, labels)
            return loss if self.factor is None else loss * self.factor

        return poisoned

    def training_step(self, batch, batch_idx):
        self.factor = self.poison.get(int(batch["consumed_samples"]))
        return super().training_step(batch, batch_idx)


class Recorder(Callback):
    """Batches actually trained (their consumed_samples) and the global step after each."""

    def __init__(self):
        self.trained, self.steps = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.trained.append(int(batch["consumed_samples"]))
        self.steps.append(trainer.global_step)


def fit(tmp_path, callbacks, max_steps, poison=None, ckpt_path=None, checkpoint_every=None):
    L.seed_everything(1234, verbose=False)
    callbacks = list(callbacks)
    if checkpoint_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=tmp_path / "checkpoints", filename="{step}", save_top_k=-1, every_n_train_steps=checkpoint_every
            )
        )
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        enable_checkpointing=bool(checkpoint_every),
        deterministic=True,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )
    module = PoisonedModule(poison)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, GPTDataModule(builtin_corpus="python-docs", seed=1234), ckpt_path=ckpt_path)
    return trainer, module


# ---------------------------------------------------------------- the detector alone (no Trainer)
def test_detector_flags_outliers_and_nan_only():
    torch.manual_seed(0)
    detector = SpikeDetector(window=20, threshold=6.0, warmup_steps=10)
    flags = []
    for step in range(80):
        loss = 8.0 * math.exp(-step / 30) + 2.0 + 0.02 * torch.randn(()).item()  # a normal, decreasing curve
        norm = 1.0 + 0.1 * torch.randn(()).item()
        if step == 2:
            loss = float("nan")  # during warm-up: still a spike
        if step == 40:
            loss *= 1e3
        if step == 60:
            norm = float("inf")
        if step == 70:
            norm *= 50
        spike, _, _ = detector.observe(torch.tensor(loss), torch.tensor(norm))
        flags.append(bool(spike))
    assert [i for i, f in enumerate(flags) if f] == [2, 40, 60, 70]
    # spikes never enter the window
    assert torch.isfinite(detector.buffer[~detector.buffer.isnan()]).all()
    assert detector.buffer[:, 0].nan_to_num(0.0).max() < 20


def test_detector_zscore_and_signal_selection():
    detector = SpikeDetector(window=10, threshold=4.0, warmup_steps=5, method="zscore", signals=("loss",))
    for step in range(12):
        spike, _, _ = detector.observe(
            torch.tensor(3.0 + 0.01 * (step % 3)), torch.tensor(100.0 if step == 11 else 1.0)
        )
        assert not bool(spike)  # grad_norm is not tested (only NaN/Inf would count)
    spike, _, z = detector.observe(torch.tensor(30.0), torch.tensor(1.0))
    assert bool(spike) and z[0] > 4.0


# ---------------------------------------------------------------- in a training run
@pytest.mark.slow
def test_log_detects_spike_at_the_right_step_without_false_positives(tmp_path):
    spikes = LossSpikeDetection(action="log", warmup_steps=5)
    trainer, module = fit(tmp_path, [spikes], max_steps=30, poison={20 * BATCH: 1e3})
    assert [(s["step"], s["consumed_samples"]) for s in spikes.spikes] == [(20, 20 * BATCH)]
    assert spikes.spikes[0]["loss"] > 1e3 and spikes.spikes[0]["z_loss"] > 6
    assert trainer.global_step == 30 and module.consumed_samples == 30 * BATCH
    assert "loss_spike" in trainer.callback_metrics and "loss_spike_z" in trainer.callback_metrics


class Snapshot(Callback):
    """Model and optimizer state before and after the batches at the given positions."""

    def __init__(self, positions):
        self.positions, self.before, self.after = set(positions), {}, {}

    @staticmethod
    def _state(trainer, pl_module):
        params = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
        optim = {
            (i, k): v.detach().clone() if torch.is_tensor(v) else v
            for i, state in trainer.optimizers[0].state_dict()["state"].items()
            for k, v in state.items()
        }
        return params, optim

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if int(batch["consumed_samples"]) in self.positions:
            self.before[int(batch["consumed_samples"])] = self._state(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if int(batch["consumed_samples"]) in self.positions:
            self.after[int(batch["consumed_samples"])] = self._state(trainer, pl_module)


def _identical(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


@pytest.mark.slow
def test_skip_leaves_params_and_optimizer_state_bit_identical_nan_included(tmp_path):
    nan_at, spike_at, normal_at = 2 * BATCH, 9 * BATCH, 10 * BATCH  # NaN inside the warm-up
    spikes = LossSpikeDetection(action="skip", warmup_steps=5)
    snap = Snapshot([nan_at, spike_at, normal_at])
    recorder = Recorder()
    trainer, module = fit(
        tmp_path, [spikes, snap, recorder], max_steps=12, poison={nan_at: float("nan"), spike_at: 1e3}
    )
    assert [s["step"] for s in spikes.spikes] == [2, 9]
    assert math.isnan(spikes.spikes[0]["loss"]) and spikes.spikes[1]["loss"] > 1e3
    for position in (nan_at, spike_at):
        (p0, o0), (p1, o1) = snap.before[position], snap.after[position]
        assert _identical(p0, p1) and _identical(o0, o1), f"update at {position} was applied"
    (p0, _), (p1, _) = snap.before[normal_at], snap.after[normal_at]
    assert not _identical(p0, p1)  # the next step trains normally
    # data and the step counter move on: 12 batches for 12 steps, no batch repeated
    assert recorder.trained == [s * BATCH for s in range(12)] and recorder.steps == list(range(1, 13))
    assert all(torch.isfinite(p).all() for p in module.model.parameters())


@pytest.mark.slow
def test_rewind_restores_and_skips_exactly_the_recorded_batches_also_after_restart(tmp_path):
    spike_step = 10
    poison = {spike_step * BATCH: 1e3}
    spikes, recorder, snap = (
        LossSpikeDetection(action="rewind", warmup_steps=5, skip_batches=3),
        Recorder(),
        Snapshot([]),
    )
    trainer, module = fit(tmp_path, [spikes, recorder, snap], max_steps=16, poison=poison, checkpoint_every=4)
    record_path = tmp_path / "checkpoints" / "loss_spike_rewinds.json"
    record = json.loads(record_path.read_text())
    (entry,) = record["rewinds"]
    assert entry["spike_step"] == spike_step and entry["restored_step"] == 8
    assert entry["checkpoint"].endswith("step=8.ckpt")
    assert entry["skipped_batches"] == [64, 72, 80]  # 3 batches from the restored position, through the spike
    assert (entry["skip_from"], entry["skip_to"]) == (64, 88)
    # trained: steps 0..10 (the spike's update vetoed), then the data resumes after the skipped range
    after = [88, 96, 104, 112, 120]
    assert recorder.trained == [s * BATCH for s in range(11)] + after
    assert not set(recorder.trained[11:]) & set(entry["skipped_batches"])
    assert trainer.global_step == 16 and module.consumed_samples == 128
    final = {k: v.clone() for k, v in module.model.state_dict().items()}

    # Restart from the checkpoint before the rewind: the record is honoured, the same batches are skipped, and the
    # run ends bit-identical to the rewound one (it restored the same checkpoint and trained the same batches).
    spikes2, recorder2 = LossSpikeDetection(action="rewind", warmup_steps=5, skip_batches=3), Recorder()
    trainer2, module2 = fit(
        tmp_path,
        [spikes2, recorder2],
        max_steps=16,
        poison=poison,
        checkpoint_every=4,
        ckpt_path=str(tmp_path / "checkpoints" / "step=8.ckpt"),
    )
    assert recorder2.trained == after and spikes2.spikes == []
    assert json.loads(record_path.read_text()) == record
    assert trainer2.global_step == 16 and module2.consumed_samples == 128
    assert _identical(final, module2.model.state_dict())


@pytest.mark.slow
def test_rewind_is_bounded(tmp_path):
    spikes = LossSpikeDetection(action="rewind", warmup_steps=3, max_rewinds=0)
    with pytest.raises(LossSpikeError, match="max_rewinds=0"):
        fit(tmp_path, [spikes], max_steps=8, poison={5 * BATCH: 1e3})
