"""Checkpoint save/load cost: the layout-independent format on 1, 2 and 4 ranks beside a plain torch.save /
torch.load of the same state (weights + Adam moments) in one process, measured in the same run.

    python benchmarks/bench_checkpoint.py [--preset gpt3-125m --ranks 1 2 4 --json out.json]

Each rank count is one torchrun launch of this script in `--worker` mode: one training step of the preset
(sequence cut to 128 tokens: the state's size depends on the parameters only) under the 3D strategy with ZeRO-1
over all ranks, then `trainer.save_checkpoint` and the strategy's `load_checkpoint`, timed between barriers.
With `--stall-rounds N` (default 3) each launch also times how long a save stops training, synchronous against
background (`async_save: true`), N saves each, alternating (medians).
Model-state bytes = fp32 weights + two fp32 Adam moments = 12 bytes per parameter (the format stores no padding
and the tied head once); "bytes on disk" is every file of the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: testing.*
from testing.local_ranks import run_on_ranks  # noqa: E402


def _trainer(preset: str, devices: int, strategy):
    import lightning as L

    from mtnlg_lightning.data.datamodule import GPTDataModule
    from mtnlg_lightning.train.module import MTNLGModule
    from testing.lightning_run import quiet_trainer

    L.seed_everything(0, verbose=False)
    module = MTNLGModule(
        preset=preset,
        model_overrides={"seq_len": 128, "vocab_size": 4096},
        micro_batch_size=1,
        global_batch_size=devices,
        preemption=False,
    )
    trainer = quiet_trainer(accelerator="cpu", devices=devices, strategy=strategy, precision="32-true", max_steps=1)
    trainer.fit(module, GPTDataModule(builtin_corpus="python-docs"))
    return trainer, module


def training_stalls(trainer, strategy, out: Path, rounds: int = 3) -> dict:
    """How long a save stops training, synchronous vs background (`async_save`), `rounds` times each, alternating:
    the time until `save_checkpoint` returns on the slowest rank (the barrier after it), and for the background save
    also the time until its write is published."""
    import statistics

    import torch.distributed as dist

    from mtnlg_lightning.checkpoint.async_save import BackgroundSaver

    background = BackgroundSaver(dist.new_group(backend="gloo"))
    sync_s, async_s, publish_s = [], [], []
    for index in range(rounds):
        for mode, times in (("sync", sync_s), ("async", async_s)):
            strategy.background_saver = background if mode == "async" else None
            dist.barrier()
            started = time.perf_counter()
            trainer.save_checkpoint(out / f"{mode}-{index}")
            dist.barrier()
            times.append(time.perf_counter() - started)
            if mode == "async":
                background.wait()
                dist.barrier()
                publish_s.append(time.perf_counter() - started)
    strategy.background_saver = None
    return {
        "stall_sync_s": statistics.median(sync_s),
        "stall_async_s": statistics.median(async_s),
        "async_publish_s": statistics.median(publish_s),
    }


def worker(preset: str, out: Path, result: Path, stall_rounds: int = 0) -> None:
    import torch.distributed as dist

    from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy

    world = int(os.environ["WORLD_SIZE"])
    strategy = MegatronDeepSpeedStrategy(zero_stage=1, print_layout=False)
    trainer, module = _trainer(preset, world, strategy)
    params = sum(p.numel() for p in module.model.parameters())
    path = out / "ckpt"
    dist.barrier()
    started = time.perf_counter()
    trainer.save_checkpoint(path)
    dist.barrier()
    save_s = time.perf_counter() - started
    mine = path / f"rank-{dist.get_rank():05d}.safetensors"
    rank_bytes = [None] * world
    dist.all_gather_object(rank_bytes, mine.stat().st_size)
    dist.barrier()
    started = time.perf_counter()
    strategy.load_checkpoint(path)
    dist.barrier()
    load_s = time.perf_counter() - started
    stalls = training_stalls(trainer, strategy, out) if stall_rounds else {}
    if dist.get_rank() == 0:
        disk = sum(f.stat().st_size for f in path.iterdir())
        result.write_text(
            json.dumps(
                {
                    "ranks": world,
                    "parameters": params,
                    "save_s": save_s,
                    "load_s": load_s,
                    "bytes_on_disk": disk,
                    "bytes_per_rank": rank_bytes,
                    "model_state_bytes": 12 * params,
                    **stalls,
                }
            )
        )


def torch_baseline(preset: str, out: Path) -> dict:
    """The same state (weights and Adam moments after one step) with torch.save / torch.load in one process."""
    import torch

    trainer, module = _trainer(preset, 1, "auto")
    optimizer = trainer.optimizers[0]
    state = {"model": module.model.state_dict(), "optimizer": optimizer.state_dict()}
    path = out / "plain.pt"
    started = time.perf_counter()
    torch.save(state, path)
    with open(path, "rb") as handle:  # the format fsyncs its files; so does this side, for the same durability
        os.fsync(handle.fileno())
    save_s = time.perf_counter() - started
    started = time.perf_counter()
    torch.load(path, map_location="cpu", weights_only=True)
    load_s = time.perf_counter() - started
    return {"save_s": save_s, "load_s": load_s, "bytes": path.stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt3-125m", help="model preset (the largest that fits: gpt3-125m)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="rank counts to measure")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--stall-rounds",
        type=int,
        default=3,
        help="saves per mode for the training stall of a synchronous vs a background (async_save) save; 0 skips",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.preset, args.out, args.result, args.stall_rounds)
        return
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    try:
        baseline = torch_baseline(args.preset, work)
        print(f"torch.save {baseline['save_s']:.2f} s, torch.load {baseline['load_s']:.2f} s, {baseline['bytes']:,} B")
        runs = []
        for ranks in args.ranks:
            out = work / f"r{ranks}"
            out.mkdir()
            worker_args = ["--worker", "--preset", args.preset, "--out", out, "--result", out / "r.json"]
            worker_args += ["--stall-rounds", args.stall_rounds]
            run_on_ranks(ranks, __file__, *worker_args, check=True, cwd=HERE.parent)
            run = json.loads((out / "r.json").read_text())
            run["save_bandwidth_vs_torch_save"] = (run["model_state_bytes"] / run["save_s"]) / (
                baseline["bytes"] / baseline["save_s"]
            )
            run["load_speed_vs_torch_load"] = baseline["load_s"] / run["load_s"]
            run["disk_vs_model_state"] = run["bytes_on_disk"] / run["model_state_bytes"]
            runs.append(run)
            print(
                f"{ranks} rank(s): save {run['save_s']:.2f} s ({run['save_bandwidth_vs_torch_save']:.2f}x torch.save's "
                f"bandwidth), load {run['load_s']:.2f} s, {run['bytes_on_disk']:,} B on disk "
                f"({run['disk_vs_model_state']:.3f}x model state), per rank {run['bytes_per_rank']}"
            )
            if "stall_sync_s" in run:
                print(
                    f"  training stall per save: synchronous {run['stall_sync_s']:.2f} s, background "
                    f"{run['stall_async_s']:.2f} s ({run['stall_async_s'] / run['stall_sync_s']:.2f}x; published "
                    f"after {run['async_publish_s']:.2f} s)"
                )
            shutil.rmtree(out)
        result = {"preset": args.preset, "torch": baseline, "runs": runs}
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
