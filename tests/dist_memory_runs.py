"""Per-rank model-state bytes of the tiny model under ZeRO 0/1/2/3, in one torchrun launch.

    torchrun --standalone --nproc-per-node 2 tests/dist_memory_runs.py OUT.pt [ZERO_STAGES...]

Each stage trains 2 steps through `parallel_harness.tiny_run` (the equivalence tests' run) with
`StateBytesProbe`; rank 0 saves {zero: {"num_params", "dp", "per_rank": [StateBytes dicts]}} for pytest.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: testing.*
from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy  # noqa: E402
from testing.parallel_harness import run_script, tiny_run  # noqa: E402
from testing.state_bytes import StateBytesProbe  # noqa: E402


def state_bytes_run(zero: int, world: int) -> dict:
    # ZeRO-3 keeps no parameter whole ("persistent"): the tiny model's would otherwise all stay unpartitioned.
    ds = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if zero == 3 else None
    probe = StateBytesProbe()
    _, trainer = tiny_run(
        MegatronDeepSpeedStrategy(zero_stage=zero, print_layout=False, deepspeed_config=ds),
        devices=world,
        max_steps=2,
        capture_steps=(),
        callbacks=[probe],
    )
    per_rank = [None] * world
    dist.all_gather_object(per_rank, probe.result.as_dict())
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.lightning_module.model.parameters())
    return {"num_params": numel, "dp": world, "per_rank": per_rank}


def main() -> None:
    out = Path(sys.argv[1])
    stages = [int(z) for z in sys.argv[2:]] or [0, 1, 2, 3]
    results = {zero: state_bytes_run(zero, int(os.environ["WORLD_SIZE"])) for zero in stages}
    if dist.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    run_script(main)
