"""LoRA runs from a Hugging Face Llama directory in the layouts named on the command line (one torchrun launch):

    torchrun --standalone --nproc-per-node 2 tests/dist_lora_runs.py OUT_DIR BASE_DIR tp2_sp pp2 zero1 zero3 cp2

Layouts are spelled as in dist_family_runs.py (context-parallel runs train on its LONG sequences, _acfull
checkpoints every block's activations). Rank 0 writes OUT_DIR/NAME.pt (losses, grad norms, parameters at step 5)
for pytest to compare with one process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: testing.*
from dist_family_runs import layout_options, strategy_of  # noqa: E402

from testing.parallel_harness import run_each, run_script, tiny_run  # noqa: E402

LORA_RUN = {"rank": 4, "alpha": 8}  # test_lora.py's


def train(layout: str, base: str) -> dict:
    strategy, micro_batch = strategy_of(layout)
    world = int(os.environ["WORLD_SIZE"])
    rec, _ = tiny_run(
        strategy, devices=world, micro_batch_size=micro_batch, init_from=base, lora=LORA_RUN, **layout_options(layout)
    )
    return {"losses": rec.losses, "grad_norms": rec.grad_norms, "params": rec.params}


def main() -> None:
    out, base = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    run_each("dist_lora_runs", sys.argv[3:], out, lambda layout: train(layout, base))


if __name__ == "__main__":
    run_script(main)
