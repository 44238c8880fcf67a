import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: the helpers the tests share with the benchmarks (testing/)
os.environ.setdefault("WANDB_MODE", "offline")


# Set in this process by in-process Trainers with a process group (Lightning writes MASTER_PORT etc. into os.environ
# and keeps the store listening on that port): a command launched afterwards must not inherit them, as a user's
# fresh shell would not, or its ranks try to listen on the port this process still holds (EADDRINUSE).
RENDEZVOUS_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
)


def tool_main(name: str):
    """tools/NAME.py's main, loaded in this process (the tools import `_bootstrap` from their own folder)."""
    sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location(f"tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def run_cli(*args: str, cwd=None, env=None, timeout=600) -> subprocess.CompletedProcess:
    """Run a console entry point as a user would (`mtnlg ...`) from a fresh shell, capturing output."""
    inherited = {key: value for key, value in os.environ.items() if key not in RENDEZVOUS_VARIABLES}
    full_env = {**inherited, "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mtnlg_lightning.train.cli", *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(autouse=True)
def no_process_group_or_environment_leaks_between_tests():
    """Each test starts as the suite did: no default process group, no rendezvous variables, and this process's
    environment as it was. In-process Trainers (module-scoped fixtures too) write RANK, LOCAL_RANK, WORLD_SIZE and
    MASTER_PORT into os.environ; a job started later with a copy takes itself for a rank launched from outside
    (Lightning starts no other ranks) and waits for its peers for ever."""
    before = {key: value for key, value in os.environ.items() if key not in RENDEZVOUS_VARIABLES}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # frees the store's port
    forget_deepspeed_groups()
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


def forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the groups of the last engine built in this process (`deepspeed.utils.groups`: the mpu
    it was given, the world and data-parallel groups); a later engine in another world would broadcast over a
    group that world no longer has ("Group ... is not registered")."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    groups.mpu = None
    for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"):
        setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP", "_ALL_TO_ALL_GROUP"):
        getattr(groups, name).clear()


@pytest.fixture(scope="session")
def demo_data():
    """(prefix, tokenizer path) of the built-in corpus, built once and cached."""
    from mtnlg_lightning.demo.builtin_corpus import build_demo_data

    return build_demo_data(progress=False)


# The modules that take longest (minutes of launches on 2 cores), longest first. They run first, so that under
# pytest-xdist (scripts/test.sh: one module per worker at a time) no worker starts a long one when the rest is done.
# pytest-xdist 3.x sorts loadfile's modules by their count of tests unless told not to (its --loadscope-reorder
# default), which put test_wheel.py and test_gpu_check.py (3 tests, 2-3 minutes each) last: `pytest_configure` turns
# that off so this order holds.
LONGEST_MODULES = (  # measured: a suite run's per-module totals (--durations=0), 2026-12-06
    "test_resilience.py",
    "test_checkpoint_layouts.py",
    "test_expert_parallel.py",
    "test_layouts_of_families_and_long_sequences.py",
    "test_wheel.py",
    "test_parallel_equivalence.py",
    "test_gpu_check.py",
    "test_interop_hf.py",
    "test_muon.py",
    "test_inference_layouts.py",
    "test_grpo.py",
    "test_checkpoints.py",
    "test_strategy_cli.py",
    "test_curation_cli.py",
    "test_cli.py",
    "test_object_store_tools.py",
    "test_planner.py",
    "test_lora.py",
    "test_bias.py",
    "test_pipeline.py",
    "test_finetune_cli.py",
    "test_model_families.py",
    "test_object_store_ray.py",
    "test_object_store_training.py",
    "test_dpo.py",
    "test_curation_ray.py",
    "test_labels.py",
    "test_moe_pipeline.py",
)


def pytest_configure(config):
    """The time budget per test file (testing/suite_budget.py): the 10 slowest files at the end, and a whole-suite
    run (no file, node id or -k given) fails when one file's tests took longer than 900 s (MTNLG_FILE_BUDGET_S)."""
    from testing.suite_budget import register

    register(config)
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep LONGEST_MODULES' order (above)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Every multi-process test is also slow, so the fast lane is one marker: -m "not slow". Longest modules first."""
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.slow)
    rank = {name: position for position, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order within a module is kept


@pytest.fixture(scope="session")
def s3():
    """A real S3 endpoint on 127.0.0.1 for the session (tests/object_store.py), this process's environment (and
    so every tool it starts) pointed at it while it runs; skipped without moto[server], boto3 and s3fs."""
    for module in ("moto.server", "boto3", "s3fs"):
        pytest.importorskip(module)
    from object_store import moto_server

    with moto_server() as store:
        yield store
