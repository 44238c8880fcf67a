"""The tiny model trained on labels of which a varying share is ignored (`parallel_harness.IgnoreLabels`), in the
layouts named on the command line (one torchrun launch):

    torchrun --standalone --nproc-per-node 2 tests/dist_label_runs.py OUT_DIR tp2 pp2 cp2 dp2

Rank 0 writes OUT_DIR/NAME.pt (losses, grad norms, parameters at step 5) for pytest to compare with one process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.*
from dist_family_runs import strategy_of  # noqa: E402
from parallel_harness import IgnoreLabels, run_each, run_script, tiny_run  # noqa: E402


def train(layout: str) -> dict:
    strategy, micro_batch = strategy_of(layout)
    # dp2: a local batch of 4 in micro-batches of 2, so the ranks accumulate as well
    micro_batch = 2 if layout.startswith("dp") else micro_batch
    rec, _ = tiny_run(strategy, devices=int(os.environ["WORLD_SIZE"]), micro_batch_size=micro_batch,
                      callbacks=[IgnoreLabels()])  # fmt: skip
    return {"losses": rec.losses, "grad_norms": rec.grad_norms, "params": rec.params}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    run_each("dist_label_runs", sys.argv[2:], out, train)


if __name__ == "__main__":
    run_script(main)
