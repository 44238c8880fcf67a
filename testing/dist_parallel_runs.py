"""Several layouts in one torchrun launch (launches are the expensive part on a small CPU machine).

    torchrun --standalone --nproc-per-node 2 testing/dist_parallel_runs.py OUT_DIR tp2 dp2_zero1 ...

Each named run trains the tiny model through Lightning with `MegatronDeepSpeedStrategy`; rank 0 writes
OUT_DIR/NAME.pt = {losses, grad_norms, lrs, params: {step: {name: full tensor}}, ...} for pytest to compare with
the single-process reference.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: testing.*
from mtnlg_lightning.parallel.zero import base_optimizer  # noqa: E402
from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy  # noqa: E402
from testing.parallel_harness import (  # noqa: E402
    CommPerStep,
    ScaleLossAt,
    VetoStep,
    run_each,
    run_script,
    tied_head_copy,
    tiny_run,
)


def strategy(tp=1, zero=0, **kw):
    return MegatronDeepSpeedStrategy(tensor_parallel=tp, zero_stage=zero, print_layout=False, **kw)


def ckpt_dir(out: Path, name: str) -> Path:
    return out / f"{name}_ckpt"


# Pipeline layouts: name -> (strategy kwargs, model overrides). Micro-batch 2: every pipeline gets >= 2
# micro-batches per step (the global batch stays 8).
PIPELINE_RUNS = {
    "pp2_1f1b": (dict(pipeline_parallel=2), None),
    "pp2_zero1": (dict(pipeline_parallel=2, zero_stage=1), None),
    "pp2_interleaved": (dict(pipeline_parallel=2, pipeline_schedule="interleaved_1f1b"), {"num_layers": 4}),
    "pp2_5blocks_zero1": (dict(pipeline_parallel=2, zero_stage=1), {"num_layers": 5}),
    "pp2_dp2_zero1": (dict(pipeline_parallel=2, zero_stage=1), None),
    "pp2_dp2_zero2": (dict(pipeline_parallel=2, zero_stage=2), None),
    "tp2_pp2_dp2_zero1": (dict(tensor_parallel=2, pipeline_parallel=2, zero_stage=1), None),
    "tp2_pp2_dp2_zero1_sp": (dict(tensor_parallel=2, pipeline_parallel=2, zero_stage=1, sequence_parallel=True), None),
    "pp2_rampup": (dict(pipeline_parallel=2), None),  # batch 2, 2, 4, ...: 1 micro-batch < 2 stages at first
}
RAMPUP = [2, 2, 12]
BF16 = "bf16_"  # run-name prefix: the same run in bf16-mixed precision
COMPILED = "compiled_"  # run-name prefix: the same run with every block torch.compile'd (`model.compile: true`)
# aot_eager: Dynamo's capture and AOTAutograd's joint forward/backward graph, where composition with the layouts
# can break, without inductor's C++ code generation (paid again by every rank of every compiled layout on 2 shared
# cores; its numerics are checked in one process by test_compiled_blocks_with_inductor_train_like_eager, marked slow).
COMPILE_BACKEND = "aot_eager"
# Runs whose torch.distributed traffic is counted per group (testing/comm_counter.py) at their last step.
COUNTED_RUNS = {"tp2_pp2_dp2_zero1", "tp2_pp2_dp2_zero1_sp", "tp2_sp"}


# Sequence parallelism: name -> (tensor_parallel, zero_stage, activation checkpointing mode, model overrides).
DROPOUT = {"hidden_dropout": 0.1}
SEQUENCE_PARALLEL_RUNS = {
    "tp2_sp": (2, 0, None, None),
    "tp2_sp_full_ac": (2, 0, "full", None),
    "tp2_sp_dropout_full_ac": (2, 0, "full", DROPOUT),  # sliced dropout masks, redrawn by the recomputation
    "tp4_sp": (4, 0, None, None),
    "tp2_dp2_zero2_sp": (2, 2, None, None),
    "tp2_dp2_zero3_sp": (2, 3, None, None),
}


def pipeline_run(name: str, world: int, out: Path, train=tiny_run):
    base = name.removesuffix("_ckpt").removesuffix("_resume")
    kwargs, overrides = PIPELINE_RUNS[base]
    comm = CommPerStep(enabled=name in COUNTED_RUNS)
    kwargs = {"tensor_parallel": 1, "zero_stage": 0, **kwargs, "print_layout": False}
    common = dict(
        devices=world,
        micro_batch_size=2,
        model_overrides=overrides,
        rampup_batch_size=RAMPUP if base == "pp2_rampup" else None,
    )
    if name.endswith("_ckpt"):
        rec, trainer = train(
            MegatronDeepSpeedStrategy(**kwargs),
            max_steps=6,
            checkpoint_dir=ckpt_dir(out, base),
            capture_steps=(0, 5, 6),
            **common,
        )
    elif name.endswith("_resume"):
        rec, trainer = train(
            MegatronDeepSpeedStrategy(**kwargs),
            max_steps=6,
            capture_steps=(6,),
            ckpt_path=ckpt_dir(out, base) / "step=3.ckpt",
            **common,
        )
    else:
        rec, trainer = train(MegatronDeepSpeedStrategy(**kwargs), max_steps=5, callbacks=[comm], **common)
    # The last stage's LM-head copy of the word embedding, after the last step (None when one rank holds both).
    return rec, trainer, {"tied_head": tied_head_copy(trainer.strategy), **comm.result(trainer)}


def layout_of(name: str) -> tuple[dict, int]:
    """Strategy kwargs and micro-batch size of a layout named like tp2_zero1, pp2_zero1, dp2_zero3 (dp follows)."""
    kwargs = {"tensor_parallel": 1, "pipeline_parallel": 1, "zero_stage": 0}
    keys = {"tp": "tensor_parallel", "pp": "pipeline_parallel", "zero": "zero_stage"}
    for part in name.split("_"):
        key = part.rstrip("0123456789")
        if key in keys:
            kwargs[keys[key]] = int(part[len(key) :])
    return kwargs, 2 if kwargs["pipeline_parallel"] > 1 else 4  # pipelines need several micro-batches


class SaveOnTrainStart(Callback):
    """Saves the state just restored from a checkpoint, before any step: the layout-to-layout round trip."""

    def __init__(self, path: Path):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


def run(name: str, out: Path, world: int) -> dict:
    """`bf16_NAME` is run NAME in bf16-mixed precision (under ZeRO: bf16 weights, fp32 master weights)."""
    precision = "bf16-mixed" if name.startswith(BF16) else "32-true"
    if name.startswith(BF16):
        name, out = name.removeprefix(BF16), out / "bf16"  # its checkpoints apart from the fp32 runs' of that name
    backend = COMPILE_BACKEND if name.startswith(COMPILED) else None
    if name.startswith(COMPILED):
        name, out = name.removeprefix(COMPILED), out / "compiled"
    train = partial(tiny_run, precision=precision, compile_backend=backend)
    extra = {}
    # name -> (strategy, run kwargs). "*_ckpt" runs 6 steps saving at step 3; "*_resume" resumes from it.
    if name.removesuffix("_ckpt").removesuffix("_resume") in PIPELINE_RUNS:
        rec, trainer, extra = pipeline_run(name, world, out, train)
    elif "_from_" in name:  # e.g. pp2_zero1_from_tp2_zero1: resume the step-3 checkpoint of another layout
        target, source = name.split("_from_")
        kwargs, micro_batch_size = layout_of(target)
        rec, trainer = train(
            MegatronDeepSpeedStrategy(**kwargs, print_layout=False),
            devices=world,
            max_steps=6,
            micro_batch_size=micro_batch_size,
            capture_steps=(6,),
            ckpt_path=ckpt_dir(out, source) / "step=3.ckpt",
            callbacks=[SaveOnTrainStart(out / f"{name}_resaved.ckpt")],
        )
    elif name in ("zero1", "zero1_mb2"):  # one process under ZeRO-1: the numerics of the ZeRO layouts, alone
        micro_batch_size = 2 if name.endswith("_mb2") else 4  # another order of the same sums
        rec, trainer = train(strategy(1, 1), devices=world, micro_batch_size=micro_batch_size, capture_steps=(0, 5))
    elif name in ("tp2", "tp4", "tp2_zero1", "dp2_zero1", "dp2_zero2", "dp2_zero3"):
        tp = int(name[2]) if name.startswith("tp") else 1
        zero = int(name[-1]) if "zero" in name else 0
        ds = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if zero == 3 else None
        rec, trainer = train(strategy(tp, zero, deepspeed_config=ds), devices=world, max_steps=5)
    elif name in SEQUENCE_PARALLEL_RUNS:
        from mtnlg_lightning.callbacks import ActivationCheckpointing

        tp, zero, recompute, overrides = SEQUENCE_PARALLEL_RUNS[name]
        ds = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if zero == 3 else None
        comm = CommPerStep(enabled=name in COUNTED_RUNS)
        callbacks = [comm] + ([ActivationCheckpointing(mode=recompute)] if recompute else [])
        rec, trainer = train(
            strategy(tp, zero, sequence_parallel=True, deepspeed_config=ds),
            devices=world,
            max_steps=5,
            callbacks=callbacks,
            model_overrides=overrides,
        )
        extra = comm.result(trainer)
    elif name.endswith("_ckpt") or name.endswith("_resume"):
        base = name.rsplit("_", 1)[0]  # e.g. tp2, tp2_dp2_zero1
        tp = 2 if base.startswith("tp2") else 1
        zero = int(base[-1]) if "zero" in base else 0
        directory = ckpt_dir(out, base)
        if name.endswith("_ckpt"):
            rec, trainer = train(
                strategy(tp, zero), devices=world, max_steps=6, checkpoint_dir=directory, capture_steps=(0, 5, 6)
            )
        else:
            rec, trainer = train(
                strategy(tp, zero), devices=world, max_steps=6, ckpt_path=directory / "step=3.ckpt", capture_steps=(6,)
            )
    elif name in ("pp2_spike_skip", "tp2_sp_spike_skip"):  # the callbacks under the 3D strategy: one decision
        from mtnlg_lightning.callbacks import LossSpikeDetection

        spikes = LossSpikeDetection(action="skip", window=5, warmup_steps=3)
        layout = dict(pipeline_parallel=2) if name == "pp2_spike_skip" else dict(tp=2, sequence_parallel=True)
        rec, trainer = train(
            strategy(**layout),
            devices=world,
            max_steps=8,
            micro_batch_size=2,
            capture_steps=(6, 7, 8),
            callbacks=[ScaleLossAt(6 * 8), spikes],
        )
        extra = {"spike_steps": [s["step"] for s in spikes.spikes]}
    elif name in ("pp2_spike_rewind", "dp2_zero1_spike_rewind"):  # restore the checkpoint before the spike
        from mtnlg_lightning.callbacks import LossSpikeDetection

        spikes = LossSpikeDetection(
            action="rewind", window=5, warmup_steps=3, skip_batches=2, record_file=str(out / f"{name}_rewinds.json")
        )
        layout = strategy(pipeline_parallel=2) if name.startswith("pp2") else strategy(1, 1)
        rec, trainer = train(
            layout,
            devices=world,
            max_steps=10,
            micro_batch_size=2,
            capture_steps=(10,),
            callbacks=[ScaleLossAt(7 * 8), spikes],
            checkpoint_dir=ckpt_dir(out, name),
            checkpoint_every=3,
        )
        extra = {
            "spike_steps": [s["step"] for s in spikes.spikes],
            "record": spikes.record,
            "tied_head": tied_head_copy(trainer.strategy),
        }
    elif name == "pp2_activation_checkpointing":
        from mtnlg_lightning.callbacks import ActivationCheckpointing

        rec, trainer = train(
            strategy(pipeline_parallel=2),
            devices=world,
            max_steps=5,
            micro_batch_size=2,
            callbacks=[ActivationCheckpointing(mode="full")],
        )
    elif name == "dp2_zero1_veto":
        rec, trainer = train(
            strategy(1, 1), devices=world, max_steps=3, capture_steps=(1, 2, 3), callbacks=[VetoStep(2)]
        )
    elif name == "roundtrip_pp2_dp2_zero2":  # load tp2 x dp2 ZeRO-1's step-3 checkpoint, save it again unchanged
        rec, trainer = train(
            strategy(pipeline_parallel=2, zero=2),
            devices=world,
            max_steps=3,
            micro_batch_size=2,
            capture_steps=(),
            ckpt_path=ckpt_dir(out, "tp2_dp2_zero1") / "step=3.ckpt",
        )
        trainer.save_checkpoint(out / "roundtrip.ckpt")
    elif name == "zero1_memory":
        rec, trainer, extra = memory_run(world)
    else:
        raise SystemExit(f"unknown run {name}")
    if backend is not None:
        extra["compiled"] = compiled_summary(trainer)
    return {"losses": rec.losses, "grad_norms": rec.grad_norms, "lrs": rec.lrs, "params": rec.params, **extra}


def compiled_summary(trainer) -> dict:
    """How many of this rank's blocks run compiled, and what Dynamo captured (graphs, graph breaks)."""
    from torch._dynamo.utils import counters

    from mtnlg_lightning.model import Block

    blocks = [m for m in trainer.lightning_module.model.modules() if isinstance(m, Block)]
    return {
        "blocks": len(blocks),
        "compiled_blocks": sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks),
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def optimizer_state_bytes(optimizer) -> int:
    """Bytes this rank holds for the optimizer: fp32 master params it updates + their state (Adam moments)."""
    inner = base_optimizer(optimizer)
    seen, total = set(), 0
    for group in inner.param_groups:
        for param in group["params"]:
            tensors = [param] + [t for t in inner.state.get(param, {}).values() if torch.is_tensor(t)]
            for t in tensors:
                if id(t) not in seen and t.dim() > 0:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    return total


def memory_run(world: int):
    """Per-rank bytes of the real ZeRO-1 optimizer state at dp=world (a trained engine) and at dp=1 (the same
    model and optimizer under a ZeRO-1 engine whose data-parallel group is this rank alone)."""
    from mtnlg_lightning.parallel.layout import ParallelLayout, ProcessGroups
    from mtnlg_lightning.parallel.zero import (
        ModelParallelUnit,
        build_deepspeed_config,
        initialize_engine,
    )

    rec, trainer = tiny_run(strategy(1, 1), devices=world, max_steps=1, capture_steps=())
    bytes_dp = optimizer_state_bytes(trainer.strategy.engine.optimizer)

    # dp=1: one group per rank, created collectively; each rank holds the full optimizer state.
    singles = [dist.new_group([r]) for r in range(world)]
    me = dist.get_rank()
    layout = ParallelLayout(1)
    groups = ProcessGroups(
        layout=layout,
        rank=0,
        coord=layout.coord(0),
        tensor_parallel_group=singles[me],
        data_parallel_group=singles[me],
        pipeline_parallel_group=singles[me],
        model_parallel_group=singles[me],
    )
    module = trainer.lightning_module
    from mtnlg_lightning.loss import cross_entropy
    from mtnlg_lightning.model import build_model

    model = build_model(module.config)
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ]
    )
    engine = initialize_engine(model, opt, build_deepspeed_config(1, 4, 1.0), ModelParallelUnit(groups))
    tokens = torch.randint(0, 4096, (4, 65))
    loss = cross_entropy(engine(tokens[:, :-1]), tokens[:, 1:])  # a plain model's logits, the plain loss
    engine.backward(loss)
    engine.step()
    bytes_one = optimizer_state_bytes(engine.optimizer)
    total = sum(p.numel() for p in model.parameters())
    return rec, trainer, {"bytes_dp": bytes_dp, "bytes_dp1": bytes_one, "num_params": total, "dp": world}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    names = sys.argv[2:]
    if COUNTED_RUNS.intersection(names):
        from testing import comm_counter

        comm_counter.install()  # before DeepSpeed builds its communication backend
    world = int(os.environ["WORLD_SIZE"])
    run_each("dist_parallel_runs", names, out, lambda name: run(name, out, world))


if __name__ == "__main__":
    run_script(main)
