"""Loss-spike detection with `log`, `skip` and `rewind` actions.

Design notes: docs/callbacks.md (loss spikes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from mtnlg_lightning.checkpoint.commit import newest_complete
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.heartbeat import heartbeat
from mtnlg_lightning.outputs import atomic_write

Action = Literal["log", "skip", "rewind"]
SIGNALS = ("loss", "grad_norm")
RECORD_NAME = "loss_spike_rewinds.json"


class LossSpikeError(MTNLGError):
    """Training stopped: too many loss-spike rewinds."""


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class SpikeDetector:
    """Rolling-window outlier test on (loss, grad_norm), computed on the tensors' device without host syncs."""

    def __init__(
        self,
        window: int = 100,
        threshold: float = 6.0,
        warmup_steps: int = 20,
        method: str = "mad",
        min_relative_deviation: float = 0.1,
        signals: tuple[str, ...] = SIGNALS,
    ):
        if window < 3:
            raise MTNLGError(f"loss-spike window must be >= 3 steps, got {window}")
        if method not in ("mad", "zscore"):
            raise MTNLGError(f"loss-spike method must be 'mad' or 'zscore', got {method!r}")
        unknown = set(signals) - set(SIGNALS)
        if unknown or not signals:
            raise MTNLGError(f"loss-spike signals must be a non-empty subset of {SIGNALS}, got {list(signals)}")
        self.window, self.threshold, self.method = window, float(threshold), method
        self.warmup_steps = max(int(warmup_steps), 3)
        self.min_relative_deviation = float(min_relative_deviation)
        self.signals = tuple(signals)
        self.buffer: torch.Tensor | None = None  # [window, 2], NaN = empty or rejected
        self.observed = 0  # steps seen (host counter; also the ring position)
        self._enabled_cache: dict = {}

    def _ensure_buffer(self, device: torch.device) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.full((self.window, 2), math.nan, device=device)
        elif self.buffer.device != device:
            self.buffer = self.buffer.to(device)
        return self.buffer

    def _enabled(self, device: torch.device, has_norm: bool) -> torch.Tensor:
        key = (str(device), has_norm)  # cached: no host-to-device copy per step
        if key not in self._enabled_cache:
            flags = [s in self.signals and (s != "grad_norm" or has_norm) for s in SIGNALS]
            self._enabled_cache[key] = torch.tensor(flags, device=device)
        return self._enabled_cache[key]

    def observe(self, loss: torch.Tensor, grad_norm: torch.Tensor | None, reduce: bool = True):
        """Returns device tensors (spike: bool [], values: [2], z: [2]) and records the step in the window."""
        loss = torch.as_tensor(loss).detach()
        device = loss.device
        buffer = self._ensure_buffer(device)
        has_norm = grad_norm is not None
        norm = torch.as_tensor(grad_norm, device=device).detach() if has_norm else torch.zeros((), device=device)
        values = torch.stack([loss.float().reshape(()), norm.float().reshape(())])
        finite = torch.isfinite(values)
        packed = torch.cat([torch.where(finite, values, torch.zeros_like(values)), (~finite).float()])
        world = _world_size()
        if reduce and world > 1:  # every rank ends with the same numbers, hence the same decision
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
            packed[:2] /= world
        nonfinite = packed[2:] > 0
        values = torch.where(nonfinite, torch.full_like(values, math.nan), packed[:2])  # reported as NaN
        enabled = self._enabled(device, has_norm)
        spike = nonfinite[0] | (nonfinite[1] & has_norm)  # NaN/Inf: always a spike
        z = torch.zeros(2, device=device)
        if self.observed >= self.warmup_steps:
            if self.method == "mad":
                center = buffer.nanmedian(dim=0).values
                spread = 1.4826 * (buffer - center).abs().nanmedian(dim=0).values
            else:
                center = buffer.nanmean(dim=0)
                spread = (buffer - center).pow(2).nanmean(dim=0).sqrt()
            scale = torch.maximum(spread, self.min_relative_deviation * center.abs()).clamp_min(1e-12)
            z = torch.nan_to_num((values - center) / scale, nan=0.0)  # empty window: no statistical test
            spike = spike | ((z > self.threshold) & enabled).any()
        # Spikes and non-finite values are stored as NaN, i.e. left out of the statistics.
        row = torch.where(spike | nonfinite, torch.full_like(values, math.nan), values)
        if not has_norm:
            row[1] = math.nan
        buffer[self.observed % self.window] = row
        self.observed += 1
        return spike, values, z

    def state_dict(self) -> dict:
        buffer = self.buffer.cpu().tolist() if self.buffer is not None else None
        return {"buffer": buffer, "observed": self.observed}

    def load_state_dict(self, state: dict) -> None:
        buffer = state.get("buffer")
        if buffer is not None and len(buffer) == self.window:
            self.buffer, self.observed = torch.tensor(buffer, dtype=torch.float32), int(state.get("observed", 0))
        else:  # no state, or the window size changed: start a fresh window (warm-up again)
            self.buffer, self.observed = None, 0


class LossSpikeDetection(Callback):
    """Detect loss / grad-norm spikes and `log`, `skip` the update, or `rewind` to a checkpoint and skip data.

    Args:
        action: ``log``, ``skip`` or ``rewind`` (see the module docstring).
        signals: which signals are tested against the window: ``loss``, ``grad_norm`` (NaN/Inf in either always is
            a spike).
        method: ``mad`` (median / median absolute deviation, robust) or ``zscore`` (mean / standard deviation).
        window: number of previous steps in the rolling window.
        threshold: a signal more than `threshold` (robust) standard deviations above the window's centre spikes.
        warmup_steps: observed steps before the statistical test starts (>= 3; NaN/Inf are caught from step 0).
        min_relative_deviation: floor of the deviation scale as a fraction of the centre, so a very flat window
            does not turn small wiggles into spikes (0.1: a signal must also exceed centre x (1 + 0.1 x threshold)).
        skip_batches: `rewind`: batches of data skipped from the restored position (at least through the spike).
        rewind_lookback_steps: `rewind`: restore the newest checkpoint with step <= spike step - this.
        max_rewinds: `rewind`: rewinds allowed in the run (over restarts); the next spike stops training.
        record_file: `rewind`: the record of skipped data; default ``<checkpoint dir>/loss_spike_rewinds.json``
            (``<default_root_dir>/...`` without a ModelCheckpoint).
    """

    def __init__(
        self,
        action: Action = "log",
        signals: list[str] | tuple[str, ...] = SIGNALS,
        method: Literal["mad", "zscore"] = "mad",
        window: int = 100,
        threshold: float = 6.0,
        warmup_steps: int = 20,
        min_relative_deviation: float = 0.1,
        skip_batches: int = 100,
        rewind_lookback_steps: int = 0,
        max_rewinds: int = 3,
        record_file: str | None = None,
    ):
        if action not in ("log", "skip", "rewind"):
            raise MTNLGError(f"loss-spike action must be log, skip or rewind, got {action!r}")
        if skip_batches < 0 or rewind_lookback_steps < 0 or max_rewinds < 0:
            raise MTNLGError("skip_batches, rewind_lookback_steps and max_rewinds must be >= 0")
        self.action = action
        self.detector = SpikeDetector(window, threshold, warmup_steps, method, min_relative_deviation, tuple(signals))
        self.skip_batches, self.rewind_lookback_steps = skip_batches, rewind_lookback_steps
        self.max_rewinds, self.record_file = max_rewinds, record_file
        self.spikes: list[dict] = []  # every detected spike (host-side, after its flag was read)
        self.record: dict = {"version": 1, "rewinds": []}
        self._record_path: Path | None = None
        self._pending: list[tuple[dict, torch.Tensor]] = []  # `log`: (step info, [spike, loss, norm, z_loss, z_norm])
        self._current: dict | None = None  # this batch: step info and device result

    # ------------------------------------------------------------------ detection
    @property
    def vetoes(self) -> bool:
        return self.action in ("skip", "rewind")

    def _check(self, trainer, pl_module, loss, grad_norm) -> dict:
        if self._current is None:  # called outside a batch (e.g. a direct should_skip_update call)
            self._current = {"step": trainer.global_step, "consumed_samples": pl_module.position.consumed_samples}
        if "result" not in self._current:
            spike, values, z = self.detector.observe(loss, grad_norm)
            self._current["result"] = torch.cat([spike.float().reshape(1), values, z])
        return self._current

    def should_skip_update(self, trainer, pl_module, loss, grad_norm) -> bool:
        """Asked by MTNLGModule before the optimizer step; same answer on every rank (the signal is reduced)."""
        current = self._check(trainer, pl_module, loss, grad_norm)
        if not self.vetoes:
            return False  # `log`: no host read here
        self._read(current)
        return current["spike"]

    @staticmethod
    def _read(current: dict) -> None:
        if "spike" not in current:
            spike, loss, norm, z_loss, z_norm = current["result"].cpu().tolist()
            current.update(spike=bool(spike), loss=loss, grad_norm=norm, z_loss=z_loss, z_grad_norm=z_norm)

    # ------------------------------------------------------------------ Lightning hooks
    def on_train_start(self, trainer, pl_module) -> None:
        self._record_path = self._resolve_record_path(trainer)
        record = None
        if trainer.is_global_zero:
            record = self._load_record(trainer)
        record = trainer.strategy.broadcast(record)
        if record is not None:
            self.record = record
            if record["rewinds"]:
                rank_zero_info(
                    f"LossSpikeDetection: honouring {len(record['rewinds'])} recorded data skip(s) from "
                    f"{self._record_path}"
                )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._jump_recorded_skips(trainer, pl_module, batch)
        self._current = {"step": trainer.global_step, "consumed_samples": pl_module.position.consumed_samples}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        current = self._current
        if current is None:
            return
        if "result" not in current:  # the update primitive did not ask the vetoers
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            if loss is None:
                self._current = None
                return
            self._check(trainer, pl_module, loss, None)
        result = current["result"]
        pl_module.log("loss_spike", result[0], on_step=True, on_epoch=False)
        pl_module.log("loss_spike_z", result[3:].max(), on_step=True, on_epoch=False)
        self._current = None
        if self.vetoes:
            self._read(current)
            if current["spike"]:
                self._report(trainer, current)
                if self.action == "rewind":
                    self._rewind(trainer, pl_module, current)
        else:
            self._pending.append((current, result))
            if len(self._pending) >= max(1, trainer.log_every_n_steps):
                self._flush(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._flush(trainer)

    def state_dict(self) -> dict:
        return {"detector": self.detector.state_dict(), "spikes": list(self.spikes)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.detector.load_state_dict(state_dict.get("detector", {}))
        self.spikes = list(state_dict.get("spikes", []))

    # ------------------------------------------------------------------ reporting
    def _flush(self, trainer) -> None:
        if not self._pending:
            return
        rows = torch.stack([r for _, r in self._pending]).cpu().tolist()  # one read for the whole batch
        for (current, _), (spike, loss, norm, z_loss, z_norm) in zip(self._pending, rows, strict=True):
            if spike:
                current.update(spike=True, loss=loss, grad_norm=norm, z_loss=z_loss, z_grad_norm=z_norm)
                self._report(trainer, current)
        self._pending = []

    def _report(self, trainer, current: dict) -> None:
        spike = {k: current[k] for k in ("step", "consumed_samples", "loss", "grad_norm", "z_loss", "z_grad_norm")}
        spike["action"] = self.action
        self.spikes.append(spike)
        message = (
            f"loss spike at step {spike['step']} (consumed_samples {spike['consumed_samples']}): "
            f"loss {spike['loss']:.4g} (z {spike['z_loss']:.1f}), grad_norm {spike['grad_norm']:.4g} "
            f"(z {spike['z_grad_norm']:.1f}); action: {self.action}"
        )
        rank_zero_warn(message)
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                try:
                    run = logger.experiment
                    run.summary["loss_spikes"] = len(self.spikes)
                    run.summary["last_loss_spike_step"] = spike["step"]
                    # wandb costs ~1.5 s at import; only a run logging to W&B (it is loaded by then) gets here
                    import wandb

                    run.alert(title="Loss spike", text=message, level=wandb.AlertLevel.WARN, wait_duration=0)
                except Exception as error:  # offline runs and old clients: the summary line is enough
                    rank_zero_info(f"LossSpikeDetection: wandb alert not sent ({error})")

    # ------------------------------------------------------------------ rewind
    def _resolve_record_path(self, trainer) -> Path:
        if self.record_file:
            return Path(self.record_file)
        for callback in trainer.checkpoint_callbacks:
            if getattr(callback, "dirpath", None):
                return Path(callback.dirpath) / RECORD_NAME
        return Path(trainer.default_root_dir) / RECORD_NAME

    def _load_record(self, trainer) -> dict | None:
        candidates = [self._record_path]
        if trainer.ckpt_path:  # a restart whose run dir moved (e.g. a new logger version): look by the checkpoint
            candidates.append(Path(trainer.ckpt_path).parent / RECORD_NAME)
        for path in candidates:
            if path is not None and path.is_file():
                with open(path, encoding="utf-8") as f:
                    record = json.load(f)
                if path != self._record_path:
                    self._write_record_file(record)
                return record
        return None

    def _write_record_file(self, record: dict) -> None:
        with atomic_write(self._record_path, "w") as f:
            json.dump(record, f, indent=1)

    def _skip_ranges(self) -> list[tuple[int, int]]:
        return [(r["skip_from"], r["skip_to"]) for r in self.record["rewinds"]]

    def _jump_recorded_skips(self, trainer, pl_module, batch) -> None:
        """Move the data position out of recorded skip ranges; restart the data stream if it moved (or is stale)."""
        start = position = pl_module.position.consumed_samples
        moved = True
        while moved:
            moved = False
            for first, end in self._skip_ranges():
                if first <= position < end:
                    position, moved = end, True
        batch_at = batch.get("consumed_samples") if isinstance(batch, dict) else None
        stale = batch_at is not None and int(batch_at) != position
        if position == start and not stale:
            return
        if position != start:
            skipped = pl_module.position.skip_to(trainer, position)  # the skipped batches count as steps
            rank_zero_info(
                f"LossSpikeDetection: skipping {skipped} recorded batch(es): samples [{start}, {position})"
                f" -> step {trainer.global_step}"
            )
        pl_module.restart_train_data()

    def _rewind(self, trainer, pl_module, spike: dict) -> None:
        done = len(self.record["rewinds"])
        if done >= self.max_rewinds:
            raise LossSpikeError(
                f"loss spike at step {spike['step']} after {done} rewind(s), "
                f"the maximum (max_rewinds={self.max_rewinds})"
                f"; training stopped. Record of skipped data: {self._record_path}. Inspect the data near "
                f"consumed_samples {spike['consumed_samples']}, lower the LR or raise max_rewinds."
            )
        path = None
        if trainer.is_global_zero:
            dirs = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
            found = newest_complete(*dirs, max_step=spike["step"] - self.rewind_lookback_steps)
            path = str(found) if found is not None else None
        path = trainer.strategy.broadcast(path)
        if path is not None:
            heartbeat("startup", "resuming")  # a checkpoint load, as a resuming start-up's
            restored_step = pl_module.position.rewind(trainer, path)  # weights, optimizer, LR, data position, step
        else:
            restored_step = trainer.global_step
            rank_zero_warn("LossSpikeDetection: no checkpoint from before the spike; skipping data from here")
        first = position = pl_module.position.consumed_samples
        batches = []
        while len(batches) < self.skip_batches or position <= spike["consumed_samples"]:
            batches.append(position)
            position += pl_module.batch_schedule.batch_size_at_samples(position)
        entry = {
            "rewind": done + 1,
            "spike_step": spike["step"],
            "spike_consumed_samples": spike["consumed_samples"],
            "loss": spike["loss"],
            "grad_norm": spike["grad_norm"],
            "checkpoint": path,
            "restored_step": restored_step,
            "skip_from": first,
            "skip_to": position,
            "skipped_batches": batches,
        }
        self.record["rewinds"].append(entry)
        if trainer.is_global_zero:
            self._write_record_file(self.record)
        trainer.strategy.barrier("loss_spike_rewind")
        rank_zero_warn(
            f"LossSpikeDetection: rewind {done + 1}/{self.max_rewinds}: restored "
            f"{path or 'nothing'} (step {restored_step}), skipping {len(batches)} batch(es) = samples "
            f"[{first}, {position}); recorded in {self._record_path}"
        )
        # The jump over [first, position) happens at the next batch start, as for a restart.
