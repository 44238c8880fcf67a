"""Start a script on several ranks of this machine, as the benchmarks and the tests do: torchrun with a standalone
rendezvous, one thread per rank (the ranks share the machine's cores), output captured."""

from __future__ import annotations

import os
import subprocess
import sys


def run_on_ranks(ranks: int, script, *args, env: dict | None = None, **run_options) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node RANKS SCRIPT ARGS...`; `run_options` go to `subprocess.run`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command += [str(script), *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, env=full_env, capture_output=True, text=True, **run_options)
