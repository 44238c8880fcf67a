"""The LightningModule: the GPT model plus the MT-NLG recipe (AdamW b2=0.95, clipping, schedules, metrics)."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from contextlib import nullcontext

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from mtnlg_lightning.checkpoint.preemption import Preemption
from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.interop.init_from import config_for_init, load_init_weights
from mtnlg_lightning.model import build_model, compile_blocks, cross_entropy
from mtnlg_lightning.resilience.restart import report_restart
from mtnlg_lightning.resilience.stragglers import StragglerMonitor
from mtnlg_lightning.resilience.watchdog import HangWatchdog
from mtnlg_lightning.train.checkpoint_io import ModelSpaceCheckpointIO
from mtnlg_lightning.train.flops import flops_per_iteration, peak_flops_for
from mtnlg_lightning.train.lr_batch_schedules import BatchSizeSchedule, LRSchedule
from mtnlg_lightning.train.optimizer_recipe import build_adamw
from mtnlg_lightning.train.peak_memory import StepPeakMemory
from mtnlg_lightning.train.step_interfaces import (
    GradientUpdater,
    ModelBuiltHook,
    PipelineExecutor,
    UpdateVeto,
    Veto,
    apply_unless_vetoed,
)
from mtnlg_lightning.train.training_position import TrainingPosition

# Lightning (2.6) warns that a checkpoint saved under manual optimization holds the weights after the step's
# update: that is what a resume from step N needs here (the update is part of step N), so the warning is noise.
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization", category=UserWarning)


class MTNLGModule(L.LightningModule):
    def __init__(
        self,
        preset: str = "tiny",
        model_overrides: dict | None = None,
        micro_batch_size: int = 8,
        global_batch_size: int = 8,
        rampup_batch_size: list[int] | None = None,
        lr: float = 5.0e-5,
        min_lr: float = 5.0e-6,
        warmup_tokens: int = 1_000_000_000,
        decay_tokens: int = 340_000_000_000,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1.0e-8,
        grad_clip: float | None = 1.0,
        peak_tflops: float | None = None,
        preemption: bool = True,
        watchdog: bool = True,
        straggler_every_n_steps: int = 50,
        init_from: str | None = None,
        compile: bool = False,
        compile_backend: str = "inductor",
    ):
        """
        Args:
            preset: model preset name (tiny, demo, gpt3-*, mtnlg-530b; demo-llama, llama3.*, qwen3-8b: the presets
                table of the reference).
            model_overrides: ModelConfig fields to change, e.g. {num_layers: 5, vocab_size: 50257}.
            micro_batch_size: sequences per forward/backward on one rank.
            global_batch_size: sequences per optimizer step over all data-parallel ranks (layout-independent).
            rampup_batch_size: [start, increment, ramp_samples] (MT-NLG: [32, 32, 5859375] = 12B tokens).
            lr, min_lr: peak and final learning rate (MT-NLG: 5e-5 -> 5e-6).
            warmup_tokens: linear warmup length in tokens (MT-NLG: 1B).
            decay_tokens: end of the cosine decay in tokens (MT-NLG: 340B).
            weight_decay: AdamW decay on weight matrices and embeddings; biases and LayerNorms get none.
            betas, eps: AdamW (MT-NLG: beta2 = 0.95 for stability).
            grad_clip: global gradient-norm clipping (MT-NLG: 1.0); null disables.
            peak_tflops: per-device peak for MFU; default from the GPU name (A100/H100/H200 bf16).
            preemption: on SIGTERM / SIGUSR1 every rank saves a checkpoint at the next step and stops cleanly
                (`checkpoint.preemption.Preemption`); false leaves signals to Lightning.
            watchdog: end a rank that stops progressing, with a stack dump and exit code 124
                (`resilience.watchdog.HangWatchdog`; add that callback yourself to change its limits).
            straggler_every_n_steps: log the slowest rank's step time every N steps and name a rank slower than
                1.5x the median (`resilience.stragglers.StragglerMonitor`); 0 disables.
            init_from: start from these weights (fresh optimizer): a Hugging Face directory (GPT-2, Llama, Qwen 2/3)
                or a project checkpoint; the architecture comes from it (see mtnlg_lightning.interop.init_from).
            compile: torch.compile each transformer block after the strategy has sharded it (faster steps on a
                GPU after a compile at the first step; bf16 with fp32 master weights is kept).
            compile_backend: torch.compile's backend (inductor; aot_eager to debug).

        Logged every step besides the loss: `peak_memory_mib`, the step's peak memory of the fullest rank
        (`torch.cuda.max_memory_allocated` on GPU, peak RSS on CPU).
        """
        super().__init__()
        self.save_hyperparameters()
        if init_from:
            self.config = config_for_init(init_from, preset, model_overrides)
            # Checkpoints rebuild the config from preset + overrides: record the resolved one.
            resolved = dataclasses.asdict(self.config)
            self.hparams["model_overrides"] = {k: v for k, v in resolved.items() if k != "name"}
        else:
            self.config = get_config(preset, **(model_overrides or {}))
        if micro_batch_size < 1:
            raise MTNLGError(f"model.micro_batch_size must be at least 1, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        ramp = rampup_batch_size or [None, None, 0]
        if len(ramp) != 3:
            raise MTNLGError("rampup_batch_size takes [start, increment, ramp_samples]")
        self.batch_schedule = BatchSizeSchedule(global_batch_size, *ramp)
        self.lr_schedule = LRSchedule(lr, min_lr, warmup_tokens, decay_tokens)
        self.grad_clip = grad_clip
        self.automatic_optimization = False  # micro-batch accumulation and the update are driven here
        self.model: torch.nn.Module | None = None
        self.loss_fn = cross_entropy
        self.position = TrainingPosition(self.batch_schedule)  # consumed samples, step, LR-schedule position
        self._step_started: float | None = None
        self._first_loss: float | None = None
        self._peak_flops: float | None = None  # per-device peak FLOP/s for MFU, resolved once per fit
        self._peak_memory: StepPeakMemory | None = None
        self._restart_train_data = False

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_model(self.config)
            if self.hparams.get("init_from"):
                load_init_weights(self.model, self.hparams.init_from)
            # Transforms that must come before any strategy wraps the model (e.g. activation checkpointing).
            trainer = self._trainer
            for callback in trainer.callbacks if trainer is not None else []:
                if isinstance(callback, ModelBuiltHook):
                    callback.on_model_built(trainer, self)
            if self.hparams.get("compile"):  # lazy: the strategy's sharding happens before the first call
                compile_blocks(self.model, self.hparams.get("compile_backend", "inductor"))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def configure_callbacks(self):
        # A callback the user configured in `trainer.callbacks` is kept (Lightning would replace it by type).
        present = self._trainer.callbacks if self._trainer is not None else []
        defaults = [Preemption()] if self.hparams.preemption else []
        if self.hparams.watchdog and not any(isinstance(cb, HangWatchdog) for cb in present):
            defaults.append(HangWatchdog())
        every = self.hparams.straggler_every_n_steps
        if every and not any(isinstance(cb, StragglerMonitor) for cb in present):
            defaults.append(StragglerMonitor(every))
        return defaults

    def setup(self, stage: str) -> None:
        # Lightning's own single-process and DDP strategies write the layout-independent checkpoint format too
        # (the 3D strategy writes it itself, sharded).
        strategy = self.trainer.strategy
        if type(strategy) in (SingleDeviceStrategy, DDPStrategy):
            strategy.checkpoint_io = ModelSpaceCheckpointIO(self)

    # ---------------------------------------------------------------- optimisation recipe
    def configure_optimizers(self):
        hp = self.hparams
        fused = self.device.type == "cuda" or None
        optimizer = build_adamw(self.model, hp.lr, hp.weight_decay, hp.betas, hp.eps, fused)
        seq_len, peak, position = self.config.seq_len, hp.lr, self.position

        def lr_multiplier(_step: int) -> float:  # the schedule runs on tokens consumed, not on steps
            return self.lr_schedule(position.consumed_samples * seq_len) / peak

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch, batch_idx):
        if self._step_started is None:
            self._step_started = time.perf_counter()
        if self._peak_memory is None:
            self._peak_memory = StepPeakMemory(self.device)
        self._peak_memory.reset()
        # The optimizer itself, not Lightning's wrapper: its step is not Lightning's to count (see below); under ZeRO
        # it is the engine's optimizer, which the engine steps.
        optimizer = self.trainer.optimizers[0]
        tokens = batch["tokens"]
        batch_start, global_batch = int(batch["consumed_samples"]), int(batch["global_batch_size"])
        lr = optimizer.param_groups[0]["lr"]
        loss = self.forward_backward(tokens)
        grad_norm = self.updater.update(optimizer, self.grad_clip, self._veto(loss))
        self.position.step_taken(self.trainer, batch_start, global_batch)  # step counter, data, LR: applied or not
        self._log_step(loss, grad_norm, lr, global_batch)
        return loss

    @property
    def consumed_samples(self) -> int:
        """Samples of the blended stream consumed so far (the data position's; read-only here)."""
        return self.position.consumed_samples

    @property
    def updater(self) -> GradientUpdater:
        """The update primitive: the strategy's own (model parallelism, ZeRO), else the local one for Lightning's
        single-process and DDP strategies (DDP has reduced the gradients in the backward already)."""
        strategy = self.trainer.strategy
        return strategy if isinstance(strategy, GradientUpdater) else _LocalUpdater(self.model, strategy)

    def forward_backward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Accumulate gradients over this rank's micro-batches; return their mean loss (detached)."""
        strategy = self.trainer.strategy
        if isinstance(strategy, PipelineExecutor) and strategy.is_pipelined:  # the schedule runs the micro-batches
            return strategy.run_pipeline(tokens, self.micro_batch_size, self.loss_fn, train=True)
        forward = self.updater.forward_module
        no_sync = getattr(strategy, "block_backward_sync", None)  # Lightning's DDP: reduce once, after the last
        chunks = tokens.split(self.micro_batch_size)
        total = torch.zeros((), device=tokens.device)
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            with nullcontext() if last or no_sync is None else no_sync():
                loss = self.loss_fn(forward(chunk[:, :-1]), chunk[:, 1:])
                self.manual_backward(loss / len(chunks))
            total += loss.detach()
        return total / len(chunks)

    def _veto(self, loss: torch.Tensor) -> Veto | None:
        """The `UpdateVeto` callbacks as one question for the update primitive; None when no callback can veto (an
        engine then keeps no undo)."""
        vetoers = [cb for cb in self.trainer.callbacks if isinstance(cb, UpdateVeto)]
        if not vetoers:
            return None

        def veto(grad_norm: torch.Tensor) -> bool:
            # Every vetoer is asked (each observes the step), every rank gets the same answers.
            votes = [cb.should_skip_update(self.trainer, self, loss, grad_norm) for cb in vetoers]
            return any(votes)

        return veto

    def restart_train_data(self) -> None:
        """Restart the train data stream at the data position after a callback moved it (loss-spike rewind, recorded
        data skips): the current epoch ends before its next batch (that batch is dropped, unused) and the next epoch
        rebuilds the train dataloader, which starts at `consumed_samples`."""
        self._restart_train_data = True
        self.trainer.reload_dataloaders_every_n_epochs = 1

    def on_train_batch_start(self, batch, batch_idx):
        if self._restart_train_data:
            self._restart_train_data = False
            return -1  # Lightning: end this epoch now
        return None

    def _log_step(self, loss, grad_norm, lr: float, global_batch: int) -> None:
        now = time.perf_counter()
        seconds, self._step_started = now - self._step_started, now
        tokens = global_batch * self.config.seq_len
        flops = flops_per_iteration(self.config, global_batch)
        tflops = flops / seconds / self.trainer.world_size / 1e12
        self.log("train_loss", loss, prog_bar=True, sync_dist=True, batch_size=global_batch)
        self.log("lr", lr, prog_bar=True)
        self.log("grad_norm", torch.as_tensor(grad_norm, dtype=torch.float32))
        self.log("consumed_samples", float(self.consumed_samples))
        self.log("consumed_tokens", float(self.consumed_samples * self.config.seq_len))
        self.log("global_batch_size", float(global_batch))
        self.log("tokens_per_sec", tokens / seconds, prog_bar=True)
        self.log("tflops_per_device", tflops)
        if self._peak_flops:
            self.log("mfu", tflops * 1e12 / self._peak_flops)
        # The rank closest to running out decides whether a layout fits: max over ranks.
        peak = torch.tensor(self._peak_memory.read_bytes() / 2**20, device=self.device)
        self.log("peak_memory_mib", peak, sync_dist=True, reduce_fx="max")

    def on_train_start(self) -> None:
        report_restart(self.trainer)

    def on_fit_start(self) -> None:
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self._peak_flops = peak_flops_for(device_name, self.hparams.peak_tflops)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self._first_loss is None and "train_loss" in self.trainer.callback_metrics:
            self._first_loss = float(self.trainer.callback_metrics["train_loss"])

    def on_train_end(self) -> None:
        last = self.trainer.callback_metrics.get("train_loss")
        if self.trainer.is_global_zero and last is not None and self._first_loss is not None:
            print(
                f"\ntrain_loss {self._first_loss:.3f} (first step) -> {float(last):.3f} (step "
                f"{self.trainer.global_step}); consumed {self.consumed_samples:,} samples"
            )

    # ---------------------------------------------------------------- evaluation
    def _eval_loss(self, batch) -> torch.Tensor:
        """Mean loss over the batch's micro-batches, forward only."""
        strategy = self.trainer.strategy
        tokens = batch["tokens"]
        if isinstance(strategy, PipelineExecutor) and strategy.is_pipelined:
            return strategy.run_pipeline(tokens, self.micro_batch_size, self.loss_fn, train=False)
        chunks = tokens.split(self.micro_batch_size)
        return torch.stack([self.loss_fn(self.model(c[:, :-1]), c[:, 1:]) for c in chunks]).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._eval_loss(batch), prog_bar=True, sync_dist=True, batch_size=len(batch["tokens"]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._eval_loss(batch), sync_dist=True, batch_size=len(batch["tokens"]))

    # ---------------------------------------------------------------- checkpoint state
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint.update(self.position.state_dict())

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.position.load_state_dict(checkpoint)
        self.configure_model()


class _LocalUpdater:
    """The update under Lightning's own strategies (one process; DDP has reduced the gradients in the backward)."""

    def __init__(self, model: torch.nn.Module, strategy):
        self.model, self.strategy = model, strategy

    @property
    def forward_module(self) -> torch.nn.Module:
        return self.model

    def update(self, optimizer, max_norm: float | None, veto: Veto | None) -> torch.Tensor:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm if max_norm else math.inf)
        apply_unless_vetoed(self.strategy, optimizer, grad_norm, veto)
        return grad_norm
