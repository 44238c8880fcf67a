"""One short `mtnlg fit`-machinery training run (Trainer + MTNLGModule + GPTDataModule) for the benchmarks and
the tests.

Shared by bench_parallel (throughput, communication), bench_memory (model-state bytes) and the tests' harness
(`parallel_harness.tiny_run`) so every layout, and the single-process baseline, trains the same model on the same
data with the same recipe.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("WANDB_MODE", "offline")

import lightning as L  # noqa: E402

from mtnlg_lightning.data.datamodule import GPTDataModule  # noqa: E402
from mtnlg_lightning.train.module import MTNLGModule  # noqa: E402

SEED = 1234
# The tiny recipe of the tests and benchmarks: a learning rate that moves the tiny model visibly within a few
# steps, its warmup and decay in tokens.
TINY_RECIPE = {"preset": "tiny", "lr": 1e-3, "min_lr": 1e-4, "warmup_tokens": 1024, "decay_tokens": 10240}


def quiet_trainer(**settings) -> L.Trainer:
    """A Trainer for a measured or tested run: no logger, progress bar, model summary or validation, no
    checkpoints unless asked, and the datamodule's own data-parallel split (Lightning's sampler would re-split it).
    `settings` are the run's own (devices, strategy, steps, callbacks, ...) and win over these."""
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "use_distributed_sampler": False,
    }
    return L.Trainer(**{**quiet, **settings})


class StepTimer(L.Callback):
    """Wall time of every training step (batch start to batch end)."""

    def __init__(self):
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args):
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args):
        self.seconds.append(time.perf_counter() - self._start)


def megatron_strategy(tp: int = 1, pp: int = 1, zero: int = 0, sp: bool = False):
    from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy

    # ZeRO-3 keeps no parameter whole ("persistent"): small models would otherwise stay unpartitioned.
    ds = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if zero == 3 else None
    return MegatronDeepSpeedStrategy(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        zero_stage=zero,
        sequence_parallel=sp,
        print_layout=False,
        deepspeed_config=ds,
    )


def fit(
    strategy="auto",
    devices: int = 1,
    preset: str = "demo",
    steps: int = 4,
    micro_batch: int = 4,
    global_batch: int = 8,
    callbacks=(),
) -> L.Trainer:
    L.seed_everything(SEED, verbose=False)
    module = MTNLGModule(
        preset=preset,
        micro_batch_size=micro_batch,
        global_batch_size=global_batch,
        lr=1e-4,
        min_lr=1e-5,
        warmup_tokens=0,
        decay_tokens=10**9,
        grad_clip=1.0,
    )
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="32-true",
        max_steps=steps,
        callbacks=list(callbacks),
    )
    trainer.fit(module, GPTDataModule(builtin_corpus="python-docs", seed=SEED))
    return trainer
