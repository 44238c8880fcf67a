"""DPO runs from a Hugging Face Llama directory in the layouts named on the command line (one torchrun launch):

    torchrun --standalone --nproc-per-node 2 tests/dist_dpo_runs.py OUT_DIR BASE_DIR PAIRS_FILE tp2 pp2 zero1 tp2_lora

Full-weight DPO (the reference: a frozen copy of each rank's shards); a layout ending in _lora trains LoRA adapters
(the reference: the base with the adapters off); one ending in _precomputed is full-weight DPO whose reference
log-probs are computed before the first step (`data.precompute_reference`: no copy). Rank 0 writes OUT_DIR/NAME.pt
(losses, grad norms, rewards, parameters at step 5) for pytest to compare with one process (`dpo_run` there too).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: testing.*
from dist_family_runs import layout_kwargs  # noqa: E402

from mtnlg_lightning.data.preferences import PreferenceDataModule  # noqa: E402
from mtnlg_lightning.dpo_loss import REWARD_NAMES  # noqa: E402
from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy  # noqa: E402
from testing.lightning_run import quiet_trainer  # noqa: E402
from testing.parallel_harness import ACCELERATOR, SEED, Recorder, fine_tuning_module, run_each, run_script  # noqa: E402

DPO_SEQ_LEN = 128
PAIRS_PER_STEP = 4
DPO_LORA = {"rank": 4, "alpha": 8}


class RewardRecorder(L.Callback):
    def __init__(self):
        self.rewards = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rewards.append([float(trainer.callback_metrics[name]) for name in REWARD_NAMES])


def dpo_run(
    base: str,
    pairs: str,
    strategy="auto",
    devices: int = 1,
    micro_batch_size: int = 2,
    lora: dict | None = None,
    precompute_reference: bool = False,
) -> dict:
    """5 DPO steps of 4 pairs (clipped, so the updates depend on the global gradient norm)."""
    L.seed_everything(SEED, verbose=False)
    module = fine_tuning_module(
        base, DPO_SEQ_LEN, micro_batch_size, PAIRS_PER_STEP, 1e-3, objective="dpo", dpo_beta=0.5, lora=lora
    )
    data = PreferenceDataModule(train=pairs, chat_template="chatml", precompute_reference=precompute_reference)
    recorder, rewards = Recorder(), RewardRecorder()
    trainer = quiet_trainer(
        accelerator=ACCELERATOR,
        devices=devices,
        strategy=strategy,
        precision="32-true",
        max_steps=5,
        callbacks=[recorder, rewards],
        deterministic=True,
    )
    trainer.fit(module, data)
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "params": recorder.params,
            "rewards": rewards.rewards}  # fmt: skip


def train(layout: str, base: str, pairs: str) -> dict:
    lora = DPO_LORA if layout.endswith("_lora") else None
    precompute = layout.endswith("_precomputed")
    kwargs = layout_kwargs(layout.removesuffix("_lora").removesuffix("_precomputed"))
    if kwargs["zero_stage"] == 3:
        kwargs["deepspeed_config"] = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    micro_batch = 1 if kwargs["pipeline_parallel"] > 1 else 2  # a pipeline needs several micro-batches
    strategy = MegatronDeepSpeedStrategy(**kwargs, print_layout=False)
    return dpo_run(base, pairs, strategy, int(os.environ["WORLD_SIZE"]), micro_batch, lora, precompute)


def main() -> None:
    out, base, pairs = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    out.mkdir(parents=True, exist_ok=True)
    run_each("dist_dpo_runs", sys.argv[4:], out, lambda layout: train(layout, base, pairs))


if __name__ == "__main__":
    run_script(main)
