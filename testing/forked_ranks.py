"""`torchrun` for the tests and benchmarks, without paying the start-up once per rank.

    python testing/forked_ranks.py --standalone --nproc-per-node 8 SCRIPT ARGS...
    python testing/forked_ranks.py --standalone --nproc-per-node 4 -m mtnlg_lightning.train.cli fit ...
    python testing/forked_ranks.py --preload=torch,mtnlg_lightning.model --standalone --nproc-per-node 2 SCRIPT ...

It takes torchrun's own arguments and builds torchrun's own launch (`torch.distributed.run.config_from_args`): the
same elastic agent, standalone rendezvous and rank environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...,
TORCHELASTIC_RUN_ID). The one difference: torchrun execs a fresh interpreter per rank, and each imports torch,
Lightning (which imports torchmetrics, and through it transformers and scipy), DeepSpeed and the trainer again, about
10 s of CPU a rank on the 2-core CI machine, 80 s of an 8-rank launch. Here the ranks are forked from one process that
imported them once (torch elastic's `forkserver` start method with those modules preloaded), then each runs the
script or module as `__main__`, as the interpreter would. A launch of ranks that build the model by hand, with
neither Lightning nor DeepSpeed, preloads only what they import (`--preload=MODULE,...`, first; `MODEL_RANK`): the
training rank's preload costs ~4 s of CPU once per launch, more than such ranks take to import torch and the model
themselves.

What stays torchrun's alone: the tests of the launch itself (the resilience drills, the crash and signal drills) and
every command a user types run through the real `torchrun` or Lightning's launcher. The product's own launchers are
not this one: `mtnlg-launch` (resilience/launch.py) is torchrun's agent with the restart policy, and
`mtnlg-eval`/`mtnlg-generate --devices N` start fresh interpreters with Lightning's rank environment and stop the
others at the first failure, with the exit code a user's script reads (inference/launch.py; its tests launch it as
users do: tests/dist_inference_runs.py). A fork server would change what those commands' ranks inherit.
"""

from __future__ import annotations

import multiprocessing
import runpy
import sys
import uuid
from pathlib import Path

# Imported once in the fork server; a module that is not installed is skipped (the fork server ignores ImportError).
# A training rank's imports (the default: every launch of the tests)...
PRELOADED = ("torch", "lightning.pytorch", "deepspeed", "mtnlg_lightning.train.cli")
# ... and those of a rank that builds the model by hand (the benchmarks of one parallel piece).
MODEL_RANK = ("torch", "mtnlg_lightning.model")


def run_as_main(target: str, is_module: bool, arguments: list[str]) -> None:
    """One rank: TARGET run as `__main__` with ARGUMENTS, as `python SCRIPT ARGS` or `python -m MODULE ARGS` would."""
    sys.argv = [target, *arguments]
    if is_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, str(Path(target).resolve().parent))  # the interpreter puts the script's folder first
        runpy.run_path(target, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.launcher.api import elastic_launch  # here: local_ranks.py reads this module's names
    from torch.distributed.run import config_from_args, get_args_parser

    argv = sys.argv[1:] if argv is None else list(argv)
    preload = PRELOADED
    if argv and argv[0].startswith("--preload="):
        preload = tuple(argv.pop(0).removeprefix("--preload=").split(","))
    args = get_args_parser().parse_args(argv)
    if args.standalone:  # as torchrun's run() reads --standalone: a c10d store on a free local port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    args.start_method = "forkserver"
    config, _, _ = config_from_args(args)
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    elastic_launch(config, run_as_main)(args.training_script, args.module, args.training_script_args)


if __name__ == "__main__":
    # Run as a script, this folder is sys.path[0]: the ranks get the repository root there instead (as under
    # `python -m testing.forked_ranks`), so a shared helper is only ever imported as testing.NAME, once.
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    main()
