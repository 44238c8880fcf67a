"""The tiny model trained on labels of which a varying share is ignored (`parallel_harness.IgnoreLabels`), or on
packed rows (`parallel_harness.PackDocuments`: names packed_LAYOUT), or on rows of one example and padding
(`parallel_harness.PadRows`: names padded_LAYOUT), with the LM head and its loss in chunks of 16 tokens
(`parallel/output_layer.py`: names chunked_LAYOUT), in the layouts named on the command line (one torchrun launch):

    torchrun --standalone --nproc-per-node 2 tests/dist_label_runs.py OUT_DIR tp2 pp2 cp2 dp2 packed_tp2_sp ...

Rank 0 writes OUT_DIR/NAME.pt (losses, grad norms, parameters at step 5) for pytest to compare with one process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: testing.*
from dist_family_runs import strategy_of  # noqa: E402

from testing.parallel_harness import (  # noqa: E402
    PADDED_SEQ_LEN,
    IgnoreLabels,
    PackDocuments,
    PadRows,
    run_each,
    run_script,
    tiny_run,
    trained,
)


def train(name: str) -> dict:
    chunked, name = name.startswith("chunked_"), name.removeprefix("chunked_")
    rows, _, rest = name.partition("_")
    rows, layout = (rows, rest) if rows in ("packed", "padded") else ("", name)
    strategy, micro_batch = strategy_of(layout)
    # dp2: a local batch of 4 in micro-batches of 2, so the ranks accumulate as well
    micro_batch = 2 if layout.startswith("dp") else micro_batch
    callback = {"packed": PackDocuments, "padded": PadRows}.get(rows, IgnoreLabels)()
    seq_len = PADDED_SEQ_LEN if rows == "padded" else None
    rec, _ = tiny_run(strategy, devices=int(os.environ["WORLD_SIZE"]), micro_batch_size=micro_batch,
                      callbacks=[callback], seq_len=seq_len, loss_chunk_tokens=16 if chunked else None)  # fmt: skip
    return trained(rec)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    run_each("dist_label_runs", sys.argv[2:], out, train)


if __name__ == "__main__":
    run_script(main)
