"""Start a script on several ranks of this machine, as the benchmarks and the tests do: torchrun's launch with a
standalone rendezvous (its ranks forked from one process that imported the trainer, `forked_ranks.py`), one thread
per rank (the ranks share the machine's cores), output captured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from testing.forked_ranks import PRELOADED

FORKED_RANKS = Path(__file__).with_name("forked_ranks.py")


def run_on_ranks(
    ranks: int, script, *args, env: dict | None = None, preload=PRELOADED, **run_options
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node RANKS SCRIPT ARGS...` with the ranks forked from one process that
    imported `preload` once (`forked_ranks.py`: torch and the trainer unless told); `run_options` go to
    `subprocess.run`."""
    command = [sys.executable, str(FORKED_RANKS)]
    command += [] if tuple(preload) == PRELOADED else [f"--preload={','.join(preload)}"]
    command += ["--standalone", f"--nproc-per-node={ranks}"]
    command += [str(script), *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, env=full_env, capture_output=True, text=True, **run_options)


def worker_rows(ranks: int, script, *args, what: str = "", preload=PRELOADED):
    """`script --worker OUT ARGS...` on `ranks` ranks, and what its rank 0 wrote to OUT (JSON); a failed launch
    ends the benchmark with the ranks' output (`what` says which launch it was)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        proc = run_on_ranks(ranks, script, "--worker", out, *args, preload=preload)
        if proc.returncode != 0:
            raise SystemExit(f"{what}launch failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def write_rows(path, rows) -> None:
    """A --worker's end: rank 0 writes `rows` (JSON) to `path` for `worker_rows`; then the world is torn down."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
