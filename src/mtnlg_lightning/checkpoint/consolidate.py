"""`mtnlg-consolidate CKPT OUT`: one model-space file of a checkpoint of any layout."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from mtnlg_lightning.checkpoint.format import open_verified
from mtnlg_lightning.checkpoint.safetensors_shards import (
    TensorSpec,
    parse_size,
    tensor_progress,
    write_safetensors,
    write_sharded,
)
from mtnlg_lightning.errors import MTNLGError, run_main
from mtnlg_lightning.outputs import check_output


def consolidate(checkpoint: Path, output: Path, optimizer: bool = False, max_shard_size: str | None = None) -> dict:
    """Write the weights (and with `optimizer`, the Adam moments and fp32 masters) of `checkpoint` as one
    safetensors file, or with `max_shard_size` as Hugging Face-style shards plus an index next to `output`; the
    model config and training position go in the files' metadata. Streamed: each tensor is read from the
    checkpoint's pieces and written a slice of rows at a time. Atomic per file: staged, then renamed, index last."""
    shard_bytes = parse_size(max_shard_size) if max_shard_size is not None else None
    check_output(output, [checkpoint], replaces_dir=False)  # never a file of the checkpoint itself
    if output.is_dir():
        raise MTNLGError(f"{output} is a directory; name the output file, e.g. {output / 'model.safetensors'}")
    reader = open_verified(checkpoint)
    manifest = reader.manifest

    def rows_of(key: str, shape: tuple[int, ...]):
        def rows(r0: int, r1: int):
            try:
                if not shape:
                    return reader.read(key)
                return reader.read(key, (r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:]))
            finally:
                reader.close()  # unmap what was read: resident memory stays one slice

        return rows

    specs = []
    for key in sorted(manifest["tensors"]):
        if optimizer or key.startswith("model/"):
            shape, dtype = reader.shape(key), getattr(torch, manifest["tensors"][key]["dtype"])
            name = key if optimizer else key.removeprefix("model/")
            specs.append(TensorSpec(name, shape, dtype, rows_of(key, shape)))
    metadata = {
        "format": "mtnlg-consolidated",
        "model_config": json.dumps(manifest["model_config"]),
        "global_step": str(manifest.get("global_step")),
        "consumed_samples": str(manifest.get("consumed_samples")),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    progress = tensor_progress(len(specs), f"writing {output.name}")
    try:
        if shard_bytes is None:
            write_safetensors(staging / output.name, specs, metadata, progress)
            files = [output.name]
        else:
            stem = output.name.removesuffix(".safetensors")
            files = write_sharded(staging, specs, shard_bytes, stem, metadata, progress)["files"]
        for name in files:  # the index, when there is one, comes last: it names only shards already in place
            os.replace(staging / name, output.parent / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {
        "files": files,
        "tensors": len(specs),
        "bytes": sum((output.parent / name).stat().st_size for name in files),
        "parameters": sum(spec.nbytes // spec.dtype.itemsize for spec in specs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mtnlg-consolidate",
        description="Write a checkpoint of any layout (TP/PP/DP/ZeRO) as one model-space safetensors file, "
        "keyed by the single-process parameter names (vocabulary unpadded, tied head stored once).",
    )
    parser.add_argument("checkpoint", type=Path, help="checkpoint folder (step=N.ckpt, or last.ckpt)")
    parser.add_argument("output", type=Path, help="output file, e.g. model.safetensors (written atomically)")
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help="write Hugging Face-style shards of at most this size (bytes, 100MB, 5GB, 2GiB) next to OUTPUT: "
        "model.safetensors -> model-0000k-of-0000n.safetensors + model.safetensors.index.json (one file when "
        "everything fits one shard); default: one file, whatever its size",
    )
    parser.add_argument(
        "--optimizer",
        action="store_true",
        help="also write the Adam moments and fp32 master weights, as keys model/<name>, optim/<name>/exp_avg, ...",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def body() -> int:
        summary = consolidate(args.checkpoint, args.output, args.optimizer, args.max_shard_size)
        files = summary["files"]
        print(
            f"wrote {', '.join(files) if len(files) <= 3 else f'{len(files)} files ({files[-1]})'} "
            f"in {args.output.parent}: {summary['tensors']} tensors, {summary['parameters']:,} values, "
            f"{summary['bytes'] / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s"
        )

    return run_main("mtnlg-consolidate", body)


if __name__ == "__main__":
    sys.exit(main())
