"""GRPO runs from a Hugging Face Llama directory in the layouts named on the command line (one torchrun launch):

    torchrun --standalone --nproc-per-node 2 tests/dist_grpo_runs.py OUT_DIR BASE_DIR MOE_DIR PROMPTS REWARDS tp2 pp2

Full weights; a layout with _lora trains LoRA adapters; one with _kl sets beta 0.04 (the reference pass: a frozen
copy of the starting weights, or the base with its adapters off); one with _mu2 sets num_iterations 2; one with
_ckpt saves a checkpoint after every step in OUT_DIR/NAME_checkpoints; one starting moe_ trains the mixture of
experts in MOE_DIR (ep2: its experts split over the 2 ranks). Rank 0 writes OUT_DIR/NAME.pt (losses, grad norms,
every step's completions gathered over the replicas and rewards, parameters at step 3) for pytest to compare with
one process (`grpo_run` there too).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: testing.*
from dist_family_runs import layout_kwargs  # noqa: E402

from mtnlg_lightning.data.prompts import PromptDataModule  # noqa: E402
from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy  # noqa: E402
from testing.lightning_run import quiet_trainer  # noqa: E402
from testing.parallel_harness import ACCELERATOR, SEED, Recorder, fine_tuning_module, run_each, run_script  # noqa: E402

GRPO_SEQ_LEN = 64
PROMPTS_PER_STEP = 4
GRPO_STEPS = 3
GRPO_SETTINGS = {"num_generations": 4, "max_completion_length": 12, "temperature": 0.9, "epsilon_high": 0.28}
GRPO_LORA = {"rank": 4, "alpha": 8}


class Rollouts(L.Callback):
    """Each step's completions of the whole global batch (every replica's, in replica order) and its reward."""

    def __init__(self):
        self.completions, self.rewards = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        mine = pl_module.objective.completions
        if dist.is_initialized():
            dp_rank, dp_size = trainer.datamodule.data_parallel_rank_and_size()
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (dp_rank, mine))
            by_replica = dict(reversed(parts))  # any rank of a replica holds its completions
            mine = [ids for replica in range(dp_size) for ids in by_replica[replica]]
        self.completions.append(mine)
        self.rewards.append(float(trainer.callback_metrics["reward"]))


def grpo_run(
    base: str,
    prompts: str,
    rewards: str,
    *,
    lora=None,
    beta=0.0,
    mu=1,
    layout=None,
    callbacks=(),
    ckpt_path=None,
    validate_every=None,
    loss_chunk_tokens=None,
):
    """3 GRPO steps of 4 prompts x 4 completions (clipped updates: the completions of steps 2 and 3 come from the
    updated policy; with `mu` 2 step 2 trains again on step 1's); `layout`: (strategy, devices, micro-batch size),
    one process by default; `validate_every` N: a validation of the prompts' first batch every N steps."""
    strategy, devices, micro_batch_size = layout or ("auto", 1, 2)
    steps = GRPO_STEPS
    L.seed_everything(SEED, verbose=False)
    grpo = {**GRPO_SETTINGS, "beta": beta, "num_iterations": mu}
    settings = {"objective": "grpo", "grpo": grpo, "rewards": [rewards], "lora": lora}
    settings["loss_chunk_tokens"] = loss_chunk_tokens
    # LoRA without the KL at 1e-3 too (it was 1e-2): step 2 is the adapters' A matrices' first Adam step, which turns
    # each gradient element into a step of about lr whatever its size, so elements that GRPO's zero-mean advantages
    # cancel to near Adam's eps move by fp32 reordering noise times lr: at 1e-2, one process's own shared-prompt and
    # row-per-completion rows ended 1.2e-5 apart and tp2's 3.1e-5 from one process, against the 2e-5 the test holds.
    # With the KL, 1e-2: the adapters must move off the reference for the KL term to weigh (its runs stay <= 1.1e-5).
    lr = 1e-2 if lora is not None and beta else 1e-3
    module = fine_tuning_module(base, GRPO_SEQ_LEN, micro_batch_size, PROMPTS_PER_STEP, lr, **settings)
    data = PromptDataModule(train=prompts, valid=prompts if validate_every else None, chat_template="chatml")
    validation = {"val_check_interval": validate_every, "limit_val_batches": 1} if validate_every else {}
    recorder, rollouts = Recorder(capture_steps=(steps,)), Rollouts()
    trainer = quiet_trainer(
        accelerator=ACCELERATOR,
        devices=devices,
        strategy=strategy,
        precision="32-true",
        max_steps=steps,
        callbacks=[recorder, rollouts, *callbacks],
        deterministic=True,
        enable_checkpointing=bool(callbacks),
        **validation,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "params": recorder.params,
            "completions": rollouts.completions, "rewards": rollouts.rewards}  # fmt: skip


def saving_every_step(folder: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, filename="{step}")


def train(layout: str, out: Path, bases: tuple[str, str], prompts: str, rewards: str) -> dict:
    lora = GRPO_LORA if "_lora" in layout else None
    beta = 0.04 if "_kl" in layout else 0.0
    mu = 2 if "_mu2" in layout else 1
    callbacks = [saving_every_step(out / f"{layout}_checkpoints")] if "_ckpt" in layout else []
    chunk = 8 if "_chunked" in layout else None  # the LM head scored 8 tokens at a time (parallel/output_layer.py)
    flags = ("_lora", "_kl", "_ckpt", "_mu2", "_chunked")
    kwargs = layout_kwargs(functools.reduce(lambda name, flag: name.replace(flag, ""), flags, layout))
    if "ep2" in layout.split("_"):
        kwargs["expert_parallel"] = 2
    if kwargs["zero_stage"] == 3:
        kwargs["deepspeed_config"] = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    micro_batch = 1 if kwargs["pipeline_parallel"] > 1 else 2  # a pipeline needs several micro-batches
    strategy = MegatronDeepSpeedStrategy(**kwargs, print_layout=False)
    world = int(os.environ["WORLD_SIZE"])
    base = bases[1] if layout.startswith("moe_") else bases[0]
    return grpo_run(
        base,
        prompts,
        rewards,
        lora=lora,
        beta=beta,
        mu=mu,
        layout=(strategy, world, micro_batch),
        callbacks=callbacks,
        loss_chunk_tokens=chunk,
    )


def main() -> None:
    out, bases, (prompts, rewards) = Path(sys.argv[1]), (sys.argv[2], sys.argv[3]), sys.argv[4:6]
    out.mkdir(parents=True, exist_ok=True)
    run_each("dist_grpo_runs", sys.argv[6:], out, lambda layout: train(layout, out, bases, prompts, rewards))


if __name__ == "__main__":
    run_script(main)
