"""`tools/consolidate_checkpoint.py CKPT OUT`: one model-space file of a checkpoint of any layout."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from mtnlg_lightning.errors import MTNLGError


def consolidate(checkpoint: Path, output: Path, optimizer: bool = False) -> dict:
    """Write the weights (and with `optimizer`, the Adam moments and fp32 masters) of `checkpoint` as one
    safetensors file, atomically; the model config and training position go in its metadata."""
    from safetensors.torch import save_file

    from mtnlg_lightning.checkpoint.format import open_verified
    from mtnlg_lightning.outputs import check_output, discard, staging_file

    check_output(output, [checkpoint], replaces_dir=False)  # never a file of the checkpoint itself
    if output.is_dir():
        raise MTNLGError(f"{output} is a directory; name the output file, e.g. {output / 'model.safetensors'}")
    reader = open_verified(checkpoint)
    manifest = reader.manifest
    keys = [k for k in sorted(manifest["tensors"]) if optimizer or k.startswith("model/")]
    tensors = {(k.removeprefix("model/") if not optimizer else k): reader.read(k) for k in keys}
    metadata = {
        "format": "mtnlg-consolidated",
        "model_config": json.dumps(manifest["model_config"]),
        "global_step": str(manifest.get("global_step")),
        "consumed_samples": str(manifest.get("consumed_samples")),
    }
    temp = staging_file(output)
    try:
        save_file(tensors, temp, metadata=metadata)
        os.replace(temp, output)
    except BaseException:
        discard(temp)
        raise
    return {
        "tensors": len(tensors),
        "bytes": output.stat().st_size,
        "parameters": sum(t.numel() for t in tensors.values()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="consolidate_checkpoint.py",
        description="Write a checkpoint of any layout (TP/PP/DP/ZeRO) as one model-space safetensors file, "
        "keyed by the single-process parameter names (vocabulary unpadded, tied head stored once).",
    )
    parser.add_argument("checkpoint", type=Path, help="checkpoint folder (step=N.ckpt, or last.ckpt)")
    parser.add_argument("output", type=Path, help="output file, e.g. model.safetensors (written atomically)")
    parser.add_argument(
        "--optimizer",
        action="store_true",
        help="also write the Adam moments and fp32 master weights, as keys model/<name>, optim/<name>/exp_avg, ...",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        summary = consolidate(args.checkpoint, args.output, args.optimizer)
    except MTNLGError as error:
        print(f"consolidate_checkpoint: error: {error}", file=sys.stderr)
        sys.exit(2)
    print(
        f"wrote {args.output}: {summary['tensors']} tensors, {summary['parameters']:,} values, "
        f"{summary['bytes'] / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
