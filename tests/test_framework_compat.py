"""The private Lightning and DeepSpeed names the project relies on still exist in the installed versions.

Each name is reached only through `train/lightning_compat.py` or `parallel/deepspeed_compat.py`; when a release
moves one, the test of that name fails saying which name, which installed version, and which module to change.
"""

from __future__ import annotations

import importlib
import re
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from mtnlg_lightning.parallel import deepspeed_compat
from mtnlg_lightning.parallel.zero import build_deepspeed_config

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "mtnlg_lightning"
LIGHTNING_COMPAT = "src/mtnlg_lightning/train/lightning_compat.py"
DEEPSPEED_COMPAT = "src/mtnlg_lightning/parallel/deepspeed_compat.py"

# The private Lightning names lightning_compat.py reaches: "module:attribute.path" -> who needs it. `Name()` stands
# for an instance made with no arguments. The overridden hooks are listed too: a rename would silently bypass them.
LIGHTNING_PRIVATE_NAMES = {
    "lightning.fabric.utilities.distributed:_distributed_is_initialized": "train/strategy.py",
    "lightning.fabric.utilities.distributed:_get_default_process_group_backend_for_device": "train/strategy.py",
    "lightning.fabric.utilities.distributed:_init_dist_connection": "train/strategy.py",
    "lightning.fabric.utilities.distributed:_sync_ddp": "train/strategy.py",
    "lightning.pytorch.strategies.launchers.subprocess_script:_SubprocessScriptLauncher": "train/strategy.py",
    "lightning.pytorch.strategies:DDPStrategy()._launcher": "train/strategy.py",
    "lightning.pytorch.strategies:ParallelStrategy._configure_launcher": "train/strategy.py (overrides it)",
    "lightning.pytorch.strategies:ParallelStrategy._reset_optimizers_and_schedulers": "train/strategy.py",
    "lightning.pytorch.cli:LightningCLI._parse_ckpt_path": "train/cli.py (overrides it)",
    "lightning.pytorch.callbacks:ModelCheckpoint._find_last_checkpoints": "checkpoint/callback.py (overrides it)",
    "lightning.pytorch:Trainer().fit_loop.epoch_loop.manual_optimization.optim_step_progress": "training_position.py",
    "lightning.pytorch:LightningModule()._trainer": "train/module.py (its model is built outside a Trainer too)",
}
# The private DeepSpeed names deepspeed_compat.py reaches -> the function of it that needs them. The attributes
# DeepSpeed sets on live objects are checked on a small engine instead (the last test): an engine's
# `_running_engine_backward` (engine_backward), a ZeRO-1/2 optimizer's `_hp_optimizer_states_linked`
# (relink_moment_fragments), a ZeRO-1/2 parameter's `_hp_mapping` (fragment_mapping), a ZeRO-3 parameter's `ds_id`,
# `ds_tensor`, `ds_shape` (is_partitioned, local_partition, full_shape), a ZeRO-3 optimizer's
# `fp32_partitioned_groups_flat` (fp32_flat_partitions).
DEEPSPEED_PRIVATE_NAMES = {
    "deepspeed.runtime.engine:DeepSpeedEngine._backward_prologue": "engine_backward",
    "deepspeed.runtime.engine:DeepSpeedEngine._backward_epilogue": "engine_backward",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.clear_backward_seen_flag": "engine_backward",
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state": (
        "relink_moment_fragments"
    ),
    "deepspeed.runtime.bf16_optimizer:BF16_Optimizer._lazy_init_hp_params_optimizer_state": "relink_moment_fragments",
    "deepspeed.runtime.engine:DeepSpeedEngine._configure_distributed_model": "engine_with_experts",
    "deepspeed.utils.groups:_EXPERT_PARALLEL_GROUP": "register_expert_groups",
    "deepspeed.utils.groups:_EXPERT_PARALLEL_GROUP_RANKS": "register_expert_groups",
    "deepspeed.utils.groups:_EXPERT_DATA_PARALLEL_GROUP": "register_expert_groups",
    "deepspeed.utils.groups:_EXPERT_DATA_PARALLEL_GROUP_RANKS": "register_expert_groups",
    # the placement ZeRO-3 reads from each expert (mark_expert_parameters): its family's name
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._autoep_expert_parallel_group": (
        "mark_expert_parameters"
    ),
}


def resolve(spec: str):
    """`module:Attr.path` with `Name()` meaning an instance made with no arguments."""
    module_name, path = spec.split(":", 1)
    value = importlib.import_module(module_name)
    for part in path.split("."):
        value = getattr(value, part.removesuffix("()"))
        if part.endswith("()"):
            value = value()
    return value


def check(spec: str, who: str, distribution: str, compat_module: str) -> None:
    try:
        resolve(spec)
    except (AttributeError, ImportError) as error:
        pytest.fail(
            f"{distribution} {version(distribution)} no longer has {spec} ({error}), which {who} relies on: "
            f"update {compat_module}"
        )


@pytest.mark.parametrize("spec", sorted(LIGHTNING_PRIVATE_NAMES))
def test_each_private_lightning_name_exists(spec):
    check(spec, LIGHTNING_PRIVATE_NAMES[spec], "lightning", LIGHTNING_COMPAT)


@pytest.mark.parametrize("spec", sorted(DEEPSPEED_PRIVATE_NAMES))
def test_each_private_deepspeed_name_exists(spec):
    pytest.importorskip("deepspeed")
    check(spec, DEEPSPEED_PRIVATE_NAMES[spec], "deepspeed", DEEPSPEED_COMPAT)


PRIVATE_LIGHTNING_IMPORT = re.compile(r"from lightning[\w.]* import[^\n]*\b_[A-Za-z]|lightning[\w.]*\._[a-z]")
PRIVATE_DEEPSPEED_ATTRIBUTE = re.compile(
    r"\b(_hp_mapping|_backward_prologue|_backward_epilogue|_lazy_init_hp|ds_id|ds_tensor|ds_shape)\b"
)


def test_no_other_module_reaches_the_private_names():
    compat = {PACKAGE / "train" / "lightning_compat.py", PACKAGE / "parallel" / "deepspeed_compat.py"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path in compat:
            continue
        text = path.read_text(encoding="utf-8")
        if PRIVATE_LIGHTNING_IMPORT.search(text) or PRIVATE_DEEPSPEED_ATTRIBUTE.search(text):
            offenders.append(str(path.relative_to(PACKAGE)))
        if "optim_step_progress" in text or re.search(r"\._trainer\b", text):
            offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []


def small_engine(stage: int):
    """A ZeRO engine over a two-layer model after one step (in the world of one process the caller made)."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = build_deepspeed_config(stage, micro_batch_size=1, grad_clip=1.0, precision="32-true")
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    engine.backward(engine(torch.ones(1, 8)).sum())
    engine.step()
    return engine


@pytest.mark.slow
def test_the_runtime_attributes_deepspeed_sets_are_where_deepspeed_compat_reads_them(monkeypatch):
    pytest.importorskip("deepspeed")
    import torch.distributed as dist

    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed insists on it, as a launcher would set it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    zero1 = small_engine(stage=1)
    first = next(zero1.module.parameters())
    mapping = deepspeed_compat.fragment_mapping(first)
    assert deepspeed_compat.has_fragment_mapping(first) and mapping is not None
    assert mapping.lp_fragment_address.numel == first.numel()
    assert mapping.get_optim_state_fragment("exp_avg").numel() == first.numel()
    deepspeed_compat.relink_moment_fragments(zero1.optimizer)
    assert zero1.optimizer._hp_optimizer_states_linked
    assert hasattr(zero1, "_running_engine_backward")
    with deepspeed_compat.engine_backward(zero1):
        pass

    zero3 = small_engine(stage=3)
    partitioned = next(zero3.module.parameters())
    assert deepspeed_compat.is_partitioned(partitioned)
    assert deepspeed_compat.full_shape(partitioned) == (8, 8)
    assert deepspeed_compat.local_partition(partitioned) is not partitioned
    assert deepspeed_compat.fp32_flat_partitions(zero3.optimizer)
