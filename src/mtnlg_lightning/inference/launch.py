"""The layout of an inference run and its processes: a training strategy YAML read for TP / PP / schedule / SP,
the checks that need no weights, and `--devices N` starting N local ranks (or the ranks torchrun / srun started).

    mtnlg-eval --checkpoint CKPT --strategy configs/strategy/tp2_pp2_dp2.yaml --devices 8 ...

Data parallelism is what is left: DP = world size / (TP x PP). ZeRO settings do not apply (nothing is trained).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.parallel.context_parallel import check_context_parallel
from mtnlg_lightning.parallel.layout import ParallelLayout
from mtnlg_lightning.parallel.parallelize import PipelineParallelSettings, check_model_fits
from mtnlg_lightning.parallel.pipeline import MULTI_STAGE, schedule_class

STRATEGY_CLASS = "MegatronDeepSpeedStrategy"


@dataclass(frozen=True)
class InferenceLayout:
    """What an inference run takes from a strategy file."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline: PipelineParallelSettings = PipelineParallelSettings()
    sequence_parallel: bool = False
    context_parallel: int = 1
    context_parallel_kernel: str = "auto"

    @property
    def model_parallel(self) -> int:
        """Ranks of one replica: TP x CP x PP (DP is what is left)."""
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel

    def describe(self, world_size: int) -> dict:
        """The layout as results.json records it."""
        return {
            "world_size": world_size,
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "data_parallel": world_size // self.model_parallel,
            "pipeline_schedule": self.pipeline.schedule,
            "virtual_pipeline_stages": self.pipeline.virtual_stages,
            "sequence_parallel": self.sequence_parallel,
            "context_parallel": self.context_parallel,
        }


def read_strategy(path: str | None) -> InferenceLayout:
    """The layout of a `trainer.strategy` YAML (configs/strategy/*.yaml); None: one replica, no model parallelism.
    Strategies other than ours (ddp, single_device) are data parallelism only."""
    if path is None:
        return InferenceLayout()
    import yaml

    file = Path(path)
    if not file.is_file():
        raise MTNLGError(f"strategy file {path} does not exist")
    try:
        spec = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise MTNLGError(f"strategy file {path} is not valid YAML ({str(error).splitlines()[0]})") from None
    if isinstance(spec, str):  # `strategy: ddp` style
        return InferenceLayout()
    if not isinstance(spec, dict):
        raise MTNLGError(f"strategy file {path} must hold a mapping with class_path and init_args")
    if not str(spec.get("class_path", "")).endswith(STRATEGY_CLASS):
        return InferenceLayout()
    args = spec.get("init_args") or {}
    schedule = args.get("pipeline_schedule", "1f1b")
    schedule_class(schedule)  # an unknown name fails with the known ones
    virtual = args.get("virtual_pipeline_stages") or (2 if schedule in MULTI_STAGE else 1)
    layout = InferenceLayout(
        tensor_parallel=int(args.get("tensor_parallel", 1)),
        pipeline_parallel=int(args.get("pipeline_parallel", 1)),
        pipeline=PipelineParallelSettings(
            schedule, virtual, args.get("first_stage_layers"), args.get("last_stage_layers")
        ),
        sequence_parallel=bool(args.get("sequence_parallel", False)),
        context_parallel=int(args.get("context_parallel", 1)),
        context_parallel_kernel=str(args.get("context_parallel_kernel", "auto")),
    )
    if min(layout.tensor_parallel, layout.pipeline_parallel, layout.context_parallel) < 1:
        raise MTNLGError(f"{path}: tensor_parallel, pipeline_parallel and context_parallel must be >= 1")
    return layout


def check_layout(layout: InferenceLayout, world_size: int, config) -> ParallelLayout:
    """Every check that needs only the model's shape: world size, heads, vocabulary and layers against the layout
    (the sequence length is the request's, not the model's: context parallelism pads it to its chunks)."""
    tp, pp, cp = layout.tensor_parallel, layout.pipeline_parallel, layout.context_parallel
    if world_size % layout.model_parallel:
        axes = f"tensor_parallel {tp}" + (f" x context_parallel {cp}" if cp > 1 else "")
        raise MTNLGError(
            f"--devices {world_size} is not a multiple of {axes} x pipeline_parallel {pp} = {layout.model_parallel}"
        )
    grid = ParallelLayout(world_size, tp, pp, gpus_per_node=None, context_parallel=cp)
    check_model_fits(grid, config, layout.pipeline, layout.sequence_parallel)
    if cp > 1:
        check_context_parallel(cp, 2 * cp * tp, tp, layout.sequence_parallel, layout.context_parallel_kernel, 0.0)
    return grid


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
    import torch.distributed as dist

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
    import torch.distributed as dist

    if _OWNED and dist.is_initialized():
        dist.destroy_process_group()
        _OWNED.clear()
