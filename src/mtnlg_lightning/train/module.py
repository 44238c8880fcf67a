"""The LightningModule: the GPT model plus the MT-NLG recipe (AdamW b2=0.95, clipping, schedules, metrics)."""

from __future__ import annotations

import dataclasses
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import nn

from mtnlg_lightning.checkpoint.preemption import Preemption
from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.interop.init_from import config_for_init, load_init_weights
from mtnlg_lightning.loss import IGNORE_INDEX, cross_entropy
from mtnlg_lightning.model import COMPILE_BACKENDS, build_model
from mtnlg_lightning.parallel.activation_checkpointing import Recompute
from mtnlg_lightning.parallel.muon import Replicas
from mtnlg_lightning.parallel.output_layer import check_chunk_tokens
from mtnlg_lightning.parallel.parallelize import parallelize_gpt
from mtnlg_lightning.resilience.restart import report_restart
from mtnlg_lightning.resilience.stragglers import StragglerMonitor
from mtnlg_lightning.resilience.watchdog import HangWatchdog
from mtnlg_lightning.train import lightning_compat
from mtnlg_lightning.train.checkpoint_io import ModelSpaceCheckpointIO
from mtnlg_lightning.train.extensions import extensions_for
from mtnlg_lightning.train.flops import flops_per_iteration, head_flops_per_token, peak_flops_for
from mtnlg_lightning.train.lr_batch_schedules import BatchSizeSchedule, LRSchedule
from mtnlg_lightning.train.objectives import build_objective
from mtnlg_lightning.train.optimizer_recipe import OneMultiplierLR, build_adamw, build_muon, optimizer_settings
from mtnlg_lightning.train.peak_memory import StepPeakMemory
from mtnlg_lightning.train.step_interfaces import LocalRunner, UpdateVeto, micro_batch_shapes
from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy
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
        activation_checkpointing: str = "none",
        activation_checkpointing_every_n: int = 2,
        loss_chunk_tokens: int | None = None,
        lora: dict | None = None,
        objective: str = "lm",
        dpo_beta: float = 0.1,
        dpo_loss: str = "sigmoid",
        dpo_label_smoothing: float = 0.0,
        grpo: dict | None = None,
        rewards: list[str | dict] | None = None,
        reward_weights: list[float] | None = None,
        optimizer: str = "adamw",
        muon: dict | None = None,
        reset_optimizer: bool = False,
        qk_clip: float | None = None,
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
            activation_checkpointing: what the backward recomputes instead of keeping: none, full (every block),
                selective (the attention core, Megatron's) or every_n (blocks 0, n, 2n, ...); applied with the
                layout (`parallel/parallelize.py`). The `ActivationCheckpointing` callback sets it too.
            activation_checkpointing_every_n: the n of every_n.
            loss_chunk_tokens: the LM head and its cross-entropy run inside the loss, only where a label counts
                (prompts and padding cost no head FLOPs), and in chunks of this many tokens, so that no [tokens x
                vocabulary] fp32 logits outlive one chunk: the loss writes each chunk's gradients in its forward,
                DPO's and GRPO's per-token scores recompute each chunk in the backward (`parallel/output_layer.py`).
                null (default): chunks only where a micro-batch's fp32 logits would pass 256 MiB (large
                vocabularies: Llama 3's 128k, Qwen's 152k, long rows); 0: one piece.
            lora: train LoRA adapters on the frozen `init_from` model instead of every weight, e.g. {rank: 16,
                alpha: 32, dropout: 0.0, targets: [q_proj, v_proj], rslora: false} (`parallel/lora.py`; targets:
                our projection names or Hugging Face's, default every attention and MLP projection). Checkpoints
                then hold the adapter and name the base by path and content hash.
            objective: what the run trains (`train/objectives`): `lm` (next-token cross-entropy), `dpo` (chosen
                and rejected answers of `--config dpo`'s data: a sample is one pair) or `grpo` (prompts of
                `--config grpo`'s data, completions sampled and scored by `rewards` each step: a sample is one
                prompt). The DPO and GRPO reference is the base with the adapters off under `lora`, else a frozen
                copy of the starting weights.
            dpo_beta: DPO's beta (> 0), the strength of the pull toward the reference.
            dpo_loss: `sigmoid` (DPO) or `ipo` (IPO: log-ratios averaged over the completion tokens).
            dpo_label_smoothing: cDPO's assumed share of flipped labels, in [0, 0.5) (sigmoid only).
            grpo: GRPO's settings with TRL's names and defaults, each optional: {num_generations: 8,
                max_completion_length: 512, temperature: 1.0, top_p: 1.0, top_k: null, loss_type: dapo,
                scale_rewards: group, importance_sampling_level: token, epsilon: 0.2, epsilon_high: null,
                num_iterations: 1, beta: 0.0, mask_truncated_completions: false}, and ours,
                log_completions_every_n_steps: 0 (a completions table every N steps) (`grpo_loss.GRPOConfig`).
            rewards: GRPO's reward functions, TRL's signature `fn(prompts, completions, completion_ids, **columns)`:
                shipped names (accuracy, format, length), `package.module:function`, `path/file.py:function` (the
                file's code runs), or a mapping {name: SPEC, ...keyword arguments} (`rewards.load_rewards`).
            reward_weights: one weight per reward function (default 1.0 each); the reward is their weighted sum.
            optimizer: `adamw` (MT-NLG's, above) or `muon`: Muon for the blocks' weight matrices (attention and MLP
                projections, one matrix per routed FFN), this AdamW for the embeddings, the LM head, norms, biases and
                routers (Moonlight's split; `parallel/muon.py`). A fused QKV weight is orthogonalised as Q, K and V, a
                tensor-parallel shard as its whole matrix (gathered over TP). Not under ZeRO 1-3 nor with adapters.
            muon: Muon's settings, torch.optim.Muon's names and defaults, each optional: {lr: the AdamW lr,
                weight_decay: the AdamW weight_decay, momentum: 0.95, nesterov: true, ns_steps: 5,
                ns_coefficients: [3.4445, -4.775, 2.0315], eps: 1.0e-7, adjust_lr: match_rms_adamw} (adjust_lr:
                torch's adjust_lr_fn, `original` or `match_rms_adamw`; the lr schedule scales both lrs alike).
            reset_optimizer: a resume starts the optimizer afresh (weights, step and data position from the
                checkpoint): how a run changes optimizer (AdamW <-> Muon) at a resume.
            qk_clip: tau of QK-clip (Kimi K2's MuonClip, with either optimizer): after each update the query and key
                weights of every attention head whose largest pre-softmax logit of the step exceeded tau are scaled
                back to tau (`parallel/qk_clip.py`); logs `qk_max_logit/LAYER` and `qk_clipped_heads`. Not with
                q/k norms or key/value heads copied over TP ranks.

        Logged every step besides the loss: `peak_memory_mib`, the step's peak memory of the fullest rank
        (`torch.cuda.max_memory_allocated` on GPU, peak RSS on CPU); `tokens_per_sec`, the documents' tokens of the
        global batch (padding not counted) per second; `padding_share`, the padding's share of the positions the
        step computed; `tflops_per_device` and `mfu`, the model FLOPs of the positions computed (padding included).
        """
        super().__init__()
        self.save_hyperparameters()
        self.muon = optimizer_settings(self.hparams)  # Muon's (None: AdamW), checked against the other settings
        if init_from:
            self.config = config_for_init(init_from, preset, model_overrides)
            # Checkpoints rebuild the config from preset + overrides: record the resolved one.
            resolved = dataclasses.asdict(self.config)
            self.hparams["model_overrides"] = {k: v for k, v in resolved.items() if k != "name"}
        else:
            self.config = get_config(preset, **(model_overrides or {}))
        if micro_batch_size < 1:
            raise MTNLGError(f"model.micro_batch_size must be at least 1, got {micro_batch_size}")
        check_chunk_tokens(loss_chunk_tokens)
        self.micro_batch_size = micro_batch_size
        ramp = rampup_batch_size or [None, None, 0]
        if len(ramp) != 3:
            raise MTNLGError("rampup_batch_size takes [start, increment, ramp_samples]")
        self.batch_schedule = BatchSizeSchedule(global_batch_size, *ramp)
        self.lr_schedule = LRSchedule(lr, min_lr, warmup_tokens, decay_tokens)
        self.grad_clip = grad_clip
        self.automatic_optimization = False  # micro-batch accumulation and the update are driven here
        self.model: torch.nn.Module | None = None
        # what the model's family and the config add to the step (`train/extensions`), before the objective
        self.extensions = extensions_for(self.config, self.hparams)
        self.objective = build_objective(self.hparams)  # what the step trains (`train/objectives`)
        self.loss_fn = self.layout_loss(cross_entropy)
        self.position = TrainingPosition(self.batch_schedule)  # consumed samples, step, LR-schedule position
        self._step_started: float | None = None
        self._first_loss: float | None = None
        # the run's documents' tokens, computed positions, model FLOPs and seconds of its steps (the summary line)
        self._run_work = torch.zeros(4, dtype=torch.float64)
        self._peak_flops: float | None = None  # per-device peak FLOP/s for MFU, resolved once per fit
        self._peak_memory: StepPeakMemory | None = None
        self._restart_train_data = False
        self.recompute = Recompute(activation_checkpointing, activation_checkpointing_every_n)
        if compile_backend not in COMPILE_BACKENDS:
            raise MTNLGError(f"model.compile_backend {compile_backend!r} is not one of {', '.join(COMPILE_BACKENDS)}")
        self.compile_with = compile_backend if compile else None  # the backend each block is compiled with
        self.runner: LocalRunner | MegatronDeepSpeedStrategy | None = None  # the step's parts, set by `setup`
        self.count_wait_s = 0.0  # this step's wait in the all-reduce of the counted labels

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = build_model(self.config)
        if self.hparams.get("init_from"):
            load_init_weights(model, self.hparams.init_from)
        strategy = lightning_compat.strategy_of(self)
        if isinstance(strategy, MegatronDeepSpeedStrategy):  # it applies the layout in its setup (collectives)
            self.set_model(model)
        else:  # one process, or Lightning's DDP: no layout, only adapters, recomputation and compilation
            parallel = parallelize_gpt(model, None, model_device(model), **self.model_transforms())
            self.on_layout_applied(parallel.model, parallel.loss_fn)

    def model_transforms(self) -> dict:
        """What the layout applies besides its sharding (`parallelize_gpt`'s keyword arguments): recomputation,
        compilation and the extensions' transforms."""
        transforms = {
            "recompute": self.recompute,
            "compile_backend": self.compile_with,
            "head_in_loss": True,
            "loss_chunk_tokens": self.hparams.get("loss_chunk_tokens"),
        }
        for extension in self.extensions:
            transforms.update(extension.model_transforms())
        return transforms

    def set_model(self, model: nn.Module) -> None:
        self.model = model
        for extension in self.extensions:
            extension.on_model(model)

    def layout_loss(self, loss_fn) -> object:
        """The micro-batch loss of the layout (`loss_fn`: its token loss) with the extensions' terms."""
        for extension in self.extensions:
            loss_fn = extension.wrap_loss(loss_fn)
        return loss_fn

    def on_layout_applied(self, model: nn.Module, loss_fn=None) -> None:
        """`model` is this rank's part of the layout (`loss_fn` its token loss, where the layout has its own: TP's
        vocabulary-parallel, PP's last stage, CP's chunks), before a checkpoint is restored into it (the 3D strategy
        calls this from its `setup`): full-weight DPO copies its reference here."""
        self.set_model(model)
        if loss_fn is not None:
            self.loss_fn = self.layout_loss(loss_fn)
        self.objective.on_layout_applied(self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def configure_callbacks(self):
        # A callback the user configured in `trainer.callbacks` is kept (Lightning would replace it by type).
        present = self.trainer.callbacks
        defaults = [Preemption()] if self.hparams.preemption else []
        if self.hparams.watchdog and not any(isinstance(cb, HangWatchdog) for cb in present):
            defaults.append(HangWatchdog())
        every = self.hparams.straggler_every_n_steps
        if every and not any(isinstance(cb, StragglerMonitor) for cb in present):
            defaults.append(StragglerMonitor(every))
        return defaults

    def setup(self, stage: str) -> None:
        strategy = self.trainer.strategy
        if self.trainer.datamodule is not None:
            self.objective.check_data(self.trainer.datamodule)
        self.objective.check_layout(self, strategy)
        if isinstance(strategy, MegatronDeepSpeedStrategy):  # it writes the layout-independent checkpoints itself
            self.runner = strategy
            return
        self.runner = LocalRunner(self, strategy)
        # Lightning's own single-process and DDP strategies write the layout-independent checkpoint format too.
        if type(strategy) in (SingleDeviceStrategy, DDPStrategy):
            strategy.checkpoint_io = ModelSpaceCheckpointIO(self)

    # ---------------------------------------------------------------- optimisation recipe
    def configure_optimizers(self):
        hp = self.hparams
        fused = self.device.type == "cuda" or None
        if self.muon is None:
            optimizer = build_adamw(self.model, hp.lr, hp.weight_decay, hp.betas, hp.eps, fused)
        else:
            groups = getattr(lightning_compat.strategy_of(self), "groups", None)  # the 3D strategy's process groups
            config = self.config
            optimizer = build_muon(
                self.model,
                self.muon,
                hp.lr,
                hp.weight_decay,
                hp.betas,
                hp.eps,
                fused,
                fused_qkv_head_dim=config.head_dim if config.fused_qkv else None,
                tp_group=groups.tensor_parallel_group if groups is not None else None,
                tp_size=groups.tensor_parallel_size if groups is not None else 1,
                replicas=Replicas(groups.replica_group, groups.replica_rank, groups.replica_size) if groups else None,
            )
        seq_len, peak, position = self.config.seq_len, hp.lr, self.position

        def lr_multiplier(_step: int) -> float:  # the schedule runs on tokens consumed, not on steps
            return self.lr_schedule(position.consumed_samples * seq_len) / peak

        scheduler = OneMultiplierLR(optimizer, lr_multiplier)
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
        batch_start, global_batch = int(batch["consumed_samples"]), int(batch["global_batch_size"])
        lr = optimizer.param_groups[0]["lr"]
        for extension in self.extensions:
            extension.before_step(self)
        loss = self.objective.forward_backward(self, batch)
        vetoers = [cb for cb in self.trainer.callbacks if isinstance(cb, UpdateVeto)]
        update = self.runner.update(optimizer, self.grad_clip, undoable=bool(vetoers))
        # Every vetoer is asked (each observes the step); every rank gets the same answers.
        votes = [cb.should_skip_update(self.trainer, self, loss, update.grad_norm) for cb in vetoers]
        vetoed = any(votes)
        update.finish(vetoed=vetoed)
        for extension in self.extensions:
            extension.after_update(self, vetoed)
        self.position.step_taken(self.trainer, batch_start, global_batch)  # step counter, data, LR: applied or not
        self._log_step(loss, update.grad_norm, lr, global_batch, self._step_work(batch))
        self.objective.log_metrics(self)
        return loss

    @property
    def consumed_samples(self) -> int:
        """Samples of the blended stream consumed so far (the data position's; read-only here)."""
        return self.position.consumed_samples

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

    def _step_work(self, batch: dict) -> torch.Tensor:
        """The global batch's [documents' tokens, computed positions, model FLOPs] this step: the positions and FLOPs
        of the micro-batches as the runner computed them (`micro_batch_shapes`: padding included, cut where the
        layout allows; the LM head's at the counted labels only), the tokens without the padding
        (`Objective.document_tokens`)."""
        rows = self.objective.computed_rows(batch)
        per_micro_batch = self.micro_batch_size * self.objective.sequences_per_sample
        shapes = micro_batch_shapes(rows, per_micro_batch, self.runner.row_multiple)
        tokens = self.objective.document_tokens(rows)
        positions = sum(n * width for n, width in shapes)
        # the LM head runs only at the counted labels (a row-index column past the inputs, DPO's and GRPO's, is not one)
        labels = rows["labels"][:, : rows["input_ids"].shape[1]]
        headless = positions - int((labels != IGNORE_INDEX).sum())
        flops = sum(flops_per_iteration(self.config, n, width) for n, width in shapes)
        flops -= 3 * head_flops_per_token(self.config) * headless  # forward and backward, as flops_per_iteration
        work = torch.tensor([tokens, positions, flops], dtype=torch.float64, device=self.device)
        world = self.trainer.world_size
        if world > 1:  # a replica's TP, PP and CP ranks hold its rows alike: the world's sum counts each world/DP times
            replica_ranks = world // getattr(self.trainer.strategy, "data_parallel_size", world)
            work = self.trainer.strategy.reduce(work, reduce_op="sum") / replica_ranks
        return work

    def _log_step(self, loss, grad_norm, lr: float, global_batch: int, work: torch.Tensor) -> None:
        now = time.perf_counter()
        seconds, self._step_started = now - self._step_started, now
        tokens, positions, flops = work.tolist()
        self._run_work += torch.tensor([tokens, positions, flops, seconds], dtype=torch.float64)
        tflops = flops / seconds / self.trainer.world_size / 1e12
        self.log("train_loss", loss, prog_bar=True, sync_dist=True, batch_size=global_batch)
        self.log("lr", lr, prog_bar=True)
        self.log("grad_norm", torch.as_tensor(grad_norm, dtype=torch.float32))
        for extension in self.extensions:
            extension.log_step(self)
        self.log("consumed_samples", float(self.consumed_samples))
        self.log("consumed_tokens", float(self.consumed_samples * self.config.seq_len))
        self.log("global_batch_size", float(global_batch))
        self.log("tokens_per_sec", tokens / seconds, prog_bar=True)  # the documents' tokens, not the padding
        self.log("padding_share", 1.0 - tokens / positions)  # of the positions computed
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
        self.objective.on_fit_start(self)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self._first_loss is None and "train_loss" in self.trainer.callback_metrics:
            self._first_loss = float(self.trainer.callback_metrics["train_loss"])

    def on_train_end(self) -> None:
        last = self.trainer.callback_metrics.get("train_loss")
        if self.trainer.is_global_zero and last is not None and self._first_loss is not None:
            tokens, positions, flops, seconds = self._run_work.tolist()
            print(
                f"\ntrain_loss {self._first_loss:.3f} (first step) -> {float(last):.3f} (step "
                f"{self.trainer.global_step}); consumed {self.consumed_samples:,} samples; "
                f"{tokens / seconds:,.0f} tokens/s, padding {1 - tokens / positions:.1%} of {positions:,.0f} "
                "positions computed, "
                f"{flops / seconds / self.trainer.world_size / 1e12:.3g} TFLOP/s per device"
            )

    # ---------------------------------------------------------------- evaluation
    def validation_step(self, batch, batch_idx):
        size = self.objective.samples_in(batch)
        self.log("val_loss", self.objective.evaluate(self, batch), prog_bar=True, sync_dist=True, batch_size=size)
        self.objective.log_metrics(self, prefix="val_")  # e.g. the held-out pairs' rewards

    def test_step(self, batch, batch_idx):
        size = self.objective.samples_in(batch)
        self.log("test_loss", self.objective.evaluate(self, batch), sync_dist=True, batch_size=size)

    # ---------------------------------------------------------------- checkpoint state
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint.update(self.position.state_dict())
        for extension in self.extensions:
            extension.on_save_checkpoint(self, checkpoint)
        checkpoint.update(self.objective.state_dict(self))

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        for extension in self.extensions:
            extension.on_load_checkpoint(self, checkpoint)
        self.position.load_state_dict(checkpoint)
        self.objective.load_state_dict(self, checkpoint)
        self.configure_model()

    # ---------------------------------------------------------------- what checkpoints record of the extensions
    @property
    def frozen_base(self) -> bool:
        """The run trains adapters over a frozen base: its buffers, as its frozen weights, are the base's."""
        return any(extension.frozen_base for extension in self.extensions)

    def manifest_entries(self) -> dict:
        """What a checkpoint's manifest records of the extensions (e.g. the adapters' settings)."""
        return {key: value for extension in self.extensions for key, value in extension.manifest_entries().items()}


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
