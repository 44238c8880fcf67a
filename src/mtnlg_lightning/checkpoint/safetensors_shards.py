"""Hugging Face's sharded safetensors layout, written and read one tensor (or one slice of rows) at a time.

Layout (as `save_pretrained` writes it): everything in one `model.safetensors` when it fits one shard, otherwise
`model-00001-of-0000N.safetensors` ... plus `model.safetensors.index.json` = {"metadata": {"total_size": bytes},
"weight_map": {tensor name: shard file}}. Shards are filled in order up to `max_shard_size`; a tensor larger than
that gets a shard of its own.

Writing never holds more than one slice of one tensor: the safetensors header only needs names, dtypes and shapes,
so it is written first and each tensor's bytes follow, produced slice by slice by a callback (a checkpoint read box
by box). Peak memory is one slice, whatever the model size.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from mtnlg_lightning.errors import MTNLGError

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' default
INDEX_SUFFIX = ".index.json"
SLICE_BYTES = 32 * 2**20  # at most this many bytes of one tensor are produced and written at a time
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(text: str | int) -> int:
    """'100MB', '5GB', '2GiB', '123456' (bytes) -> bytes; units as Hugging Face reads them (GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in UNITS:
        raise MTNLGError(f"shard size {text!r} is not a size: write bytes or a number with KB, MB, GB, MiB, GiB...")
    size = int(float(match.group(1)) * UNITS[unit])
    if size < 1:
        raise MTNLGError(f"shard size {text!r} must be at least one byte")
    return size


@dataclass
class TensorSpec:
    """A tensor to write: its name, shape and dtype, and `rows(r0, r1)` giving rows [r0, r1) of it (any dtype;
    converted on write). A 0-d tensor has one "row"."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: Callable[[int, int], torch.Tensor]

    @property
    def nbytes(self) -> int:
        count = 1
        for s in self.shape:
            count *= s
        return count * torch.empty((), dtype=self.dtype).element_size()

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 1


def plan_shards(specs: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Greedy in order, as Hugging Face: a new shard when the next tensor would overflow the current one."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_names(count: int, stem: str = "model") -> list[str]:
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def write_safetensors(
    path: Path,
    specs: list[TensorSpec],
    metadata: dict[str, str] | None = None,
    progress=None,
    slice_bytes: int = SLICE_BYTES,
):
    """One safetensors file, streamed: the header from the specs, then each tensor `slice_bytes` at a time (whole
    rows, at least one), then fsync."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for spec in specs:
        if spec.dtype not in SAFETENSORS_DTYPES:
            raise MTNLGError(f"{spec.name}: dtype {spec.dtype} has no safetensors name")
        header[spec.name] = {
            "dtype": SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for spec in specs:
            row_bytes = max(1, spec.nbytes // max(1, spec.num_rows))
            step = max(1, slice_bytes // row_bytes)
            written = 0
            for r0 in range(0, spec.num_rows, step):
                r1 = min(spec.num_rows, r0 + step)
                part = spec.rows(r0, r1).to(spec.dtype).contiguous()
                expected = (r1 - r0, *spec.shape[1:]) if spec.shape else ()
                if tuple(part.shape) != expected:
                    raise MTNLGError(f"{spec.name}: rows {r0}:{r1} came as {tuple(part.shape)}, expected {expected}")
                handle.write(part.reshape(-1).view(torch.uint8).numpy())  # the bytes, not a copy of them
                written += part.numel() * part.element_size()
                del part
            if written != spec.nbytes:
                raise MTNLGError(f"{spec.name}: wrote {written} bytes, expected {spec.nbytes}")
            if progress is not None:
                progress(spec)
        handle.flush()
        os.fsync(handle.fileno())


def write_sharded(
    directory: Path,
    specs: list[TensorSpec],
    max_shard_size: int,
    stem: str = "model",
    metadata: dict[str, str] | None = None,
    progress=None,
) -> dict:
    """Write `specs` into `directory` in Hugging Face's layout (one file, or shards plus the index, written last).
    The caller makes it atomic (a staging directory renamed into place). Slices of a quarter shard (at most
    SLICE_BYTES) keep the memory a fraction of a shard. Returns a summary."""
    shards = plan_shards(specs, max_shard_size)
    names = shard_names(len(shards), stem)
    slice_bytes = min(SLICE_BYTES, max(1, max_shard_size // 4))
    for name, shard in zip(names, shards, strict=True):
        write_safetensors(directory / name, shard, metadata, progress, slice_bytes)
    total = sum(spec.nbytes for spec in specs)
    files = list(names)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {spec.name: name for name, shard in zip(names, shards, strict=True) for spec in shard},
        }
        index_name = f"{stem}.safetensors{INDEX_SUFFIX}"
        (directory / index_name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        files.append(index_name)
    return {"files": files, "shards": len(shards), "bytes": total, "tensors": len(specs)}


def tensor_progress(total: int, desc: str):
    """A per-tensor progress callback: a bar on a terminal (stderr), nothing otherwise."""

    bar = tqdm(total=total, desc=desc, unit="tensor", disable=not sys.stderr.isatty(), leave=False)
    return lambda spec: bar.update(1)


# --------------------------------------------------------------------------------------------------- reading
class ShardedTensors:
    """The tensors of a Hugging Face weights directory (`model.safetensors`, or shards with an index), opened
    lazily, one shard at a time: `names`, `read(name)`. Construction checks the index against the shards'
    headers (names inside the directory, every shard present, every indexed tensor in its shard) and reads no
    tensor data."""

    def __init__(self, directory: Path, stem: str = "model"):
        self.directory = Path(directory)
        single = self.directory / f"{stem}.safetensors"
        index = self.directory / f"{stem}.safetensors{INDEX_SUFFIX}"
        self.shapes: dict[str, tuple[int, ...]] = {}
        if single.is_file():
            self.shapes = self._shapes_in(single, safe_open)
            self.where = dict.fromkeys(self.shapes, single.name)
            return
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise MTNLGError(f"{index} is not a readable safetensors index ({type(exc).__name__}: {exc})") from None
        found: dict[str, dict[str, tuple[int, ...]]] = {}
        for tensor, shard in sorted(weight_map.items()):
            # A plain file name, checked as written (not resolved: the Hub's cache links shards to its blobs).
            if not isinstance(shard, str) or shard in ("", ".", "..") or Path(shard).name != shard or "\\" in shard:
                raise MTNLGError(f"{index}: shard {shard!r} of {tensor} is not a file inside {self.directory}")
            path = self.directory / shard
            if shard not in found:
                if not path.is_file():
                    raise MTNLGError(f"{index} names shard {shard}, which is missing from {self.directory}")
                found[shard] = self._shapes_in(path, safe_open)
            if tensor not in found[shard]:
                raise MTNLGError(f"{index} places {tensor} in {shard}, which holds no such tensor")
            self.shapes[tensor] = found[shard][tensor]
        self.where = dict(weight_map)

    @staticmethod
    def _shapes_in(path: Path, safe_open) -> dict[str, tuple[int, ...]]:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        except Exception as exc:  # noqa: BLE001 - a corrupt file is one line for the user
            raise MTNLGError(f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc})") from None

    @property
    def names(self) -> list[str]:
        return sorted(self.where)

    def read(self, name: str) -> torch.Tensor:
        """One tensor; its shard is opened (memory-mapped) for this read only, so touched pages do not add up."""
        with safe_open(str(self.directory / self.where[name]), framework="pt", device="cpu") as handle:
            return handle.get_tensor(name)
