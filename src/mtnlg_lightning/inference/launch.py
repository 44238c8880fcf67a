"""The layout of an inference run and its processes: a training strategy YAML read for TP / PP / schedule / SP / CP
(`parallel/config.py`, as training reads it), the checks that need no weights, and `--devices N` starting N local
ranks (or the ranks torchrun / srun started).

    mtnlg-eval --checkpoint CKPT --strategy configs/strategy/tp2_pp2_dp2.yaml --devices 8 ...

Data parallelism is what is left: DP = world size / (TP x CP x PP). ZeRO settings do not apply (nothing is
trained), but a strategy training would refuse is refused here too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.parallel.config import ParallelConfig, read_strategy_file
from mtnlg_lightning.parallel.layout import ParallelLayout, gpus_per_node_from_env


def read_strategy(path: str | None) -> ParallelConfig:
    """The layout of a `trainer.strategy` YAML (configs/strategy/*.yaml), read as training reads it; None: one
    replica, no model parallelism. Strategies other than ours (ddp, single_device) are data parallelism only."""
    return ParallelConfig() if path is None else read_strategy_file(path)


def check_layout(layout: ParallelConfig, world_size: int, config) -> ParallelLayout:
    """Every check that needs only the model's shape, as training makes them (`ParallelConfig.validate`), except
    that the sequence is the request's, not the model's: its width is padded to what SP and CP cut."""
    return layout.validate(config, world_size, inference=True, gpus_per_node=gpus_per_node_from_env())


# ------------------------------------------------------------------------------------------- processes
def launched_world_size() -> int | None:
    """The world size torchrun / srun / our own launcher set, or None in a plain process."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def world_size_for(devices: int | None) -> int:
    """The run's world size: the launcher's when started by one (then --devices must agree), else --devices."""
    launched = launched_world_size()
    if launched is not None:
        if devices is not None and devices != launched:
            raise MTNLGError(f"--devices {devices} differs from the {launched} ranks the launcher started")
        return launched
    if devices is not None and devices < 1:
        raise MTNLGError(f"--devices must be >= 1, got {devices}")
    return devices or 1


def needs_launch(world_size: int) -> bool:
    return world_size > 1 and launched_world_size() is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(module: str, argv: list[str], world_size: int, env: dict[str, str] | None = None) -> int:
    """Start `python -m module argv` as ranks 0..N-1 of one local world (as Lightning's launcher does for
    `mtnlg fit --trainer.devices N`) and wait; if one fails, the others are stopped. Returns the worst exit code."""
    return launch_command([sys.executable, "-m", module, *argv], world_size, env)


def launch_command(command: list[str], world_size: int, extra_env: dict[str, str] | None = None) -> int:
    """`command` as every rank of a local world of `world_size` (see `launch_local`), with `extra_env` set."""
    port = str(_free_port())
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            **(extra_env or {}),
        }
        procs.append(subprocess.Popen(command, env=env))
    codes: dict[int, int] = {}
    try:
        while len(codes) < len(procs):
            for i, proc in enumerate(procs):
                if i in codes:
                    continue
                try:
                    codes[i] = proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
                if codes[i] != 0:  # a failed rank leaves the others waiting in a collective: stop them
                    for j, other in enumerate(procs):
                        if j not in codes:
                            other.terminate()
    except KeyboardInterrupt:
        for proc in procs:
            proc.terminate()
        raise
    failed = [c for c in codes.values() if c != 0]
    return (2 if 2 in failed else max(failed, key=abs)) if failed else 0


def init_distributed(device_arg: str) -> torch.device:
    """Join the world the launcher described (NCCL on GPUs, gloo on CPUs); this rank's device."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_arg == "auto":
        device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(device_arg)
        if device.type == "cuda" and device.index is None:
            device = torch.device(f"cuda:{local}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
        _OWNED.append(True)  # this module started the world, so it ends it (`finish`)
    return device


_OWNED: list[bool] = []


def finish() -> None:
    """End the world if `init_distributed` started it (a caller that started its own keeps it)."""
    if _OWNED and dist.is_initialized():
        dist.destroy_process_group()
        _OWNED.clear()
