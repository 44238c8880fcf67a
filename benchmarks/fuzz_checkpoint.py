"""Fuzz the checkpoint reader: seeded mutations of a real (tiny) checkpoint, each either loading exactly the
original tensors or failing with one `MTNLGError` line -- never a traceback, never silent zeros, never a read
outside the checkpoint folder.

    python benchmarks/fuzz_checkpoint.py --cases 5000 --seed 0

The checkpoint, its mutations and the checks of each case: testing/checkpoint_fuzzing.py (the tests run a few
hundred cases of the same generator).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: testing.*
from testing.checkpoint_fuzzing import run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fuzz_checkpoint.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=5000, help="number of mutated checkpoints (default 5000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mutations (default 0)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.cases, args.seed, Path(tmp), progress=True)
    for failure in result["failures"][:10]:
        print(failure, file=sys.stderr)
    print(
        f"{result['cases']} cases in {result['seconds']:.1f} s: {result['loaded']} loaded the original tensors, "
        f"{result['refused']} refused with one line, {len(result['failures'])} failures"
    )
    sys.exit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()
