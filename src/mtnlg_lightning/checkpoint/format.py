"""The on-disk format: model-space tensor pieces in safetensors files, a pickle-free manifest written last.

A checkpoint is a folder:
    rank-00000.safetensors ...  pieces of tensors in model space: `model/<name>`, `master/<name>` (fp32 master
                                weights where they differ from the model's), `optim/<name>/<state>` (Adam moments);
                                each piece is a box (offsets, shape) of the tensor's global, layout-free shape
    meta.pt                     training state that is not per-parameter (loops, LR scheduler, callbacks,
                                consumed_samples, optimizer hyper-parameters and step); read with weights_only=True
    manifest.json               written last: every tensor's global shape and pieces, every file's size and xxh64

See docs/checkpoints.md for why this and not torch.distributed.checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from mtnlg_lightning.checkpoint.validate import (
    CheckpointError,
    check_manifest,
    check_meta,
    check_pieces_in_file,
    config_mismatch,
    config_of,
    is_int,
    pieces_by_file,
)
from mtnlg_lightning.data.chat_template import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE
from mtnlg_lightning.errors import one_line
from mtnlg_lightning.outputs import atomic_write

FORMAT_NAME = "mtnlg-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
META = "meta.pt"


@dataclass
class Piece:
    """One box of a tensor in model space, held by this rank; or, with `flat_start`, a contiguous range of the
    tensor's row-major elements (a ZeRO fragment, written without gathering it)."""

    key: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]
    flat_start: int | None = None


@dataclass
class WrittenFile:
    name: str
    size: int
    xxh64: str
    pieces: dict[str, dict] = field(default_factory=dict)  # key -> {offsets, shape, global_shape, dtype}


def file_digest(path: Path, chunk: int = 1 << 24) -> str:
    digest = xxhash.xxh64()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_pieces(directory: Path, name: str, pieces: list[Piece]) -> WrittenFile:
    """One safetensors file of this rank's pieces, flushed to disk, with its size and checksum."""
    tensors = {p.key: p.tensor.detach().to("cpu").contiguous() for p in pieces}
    path = directory / name
    save_file(tensors if tensors else {"__empty__": torch.zeros(0)}, str(path))
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    written = WrittenFile(name, path.stat().st_size, file_digest(path))  # read back from the page cache
    for p in pieces:
        entry = {"global_shape": list(p.global_shape), "dtype": str(p.tensor.dtype).removeprefix("torch.")}
        if p.flat_start is not None:
            entry["flat"] = [p.flat_start, p.tensor.numel()]
        else:
            entry.update(offsets=list(p.offsets), shape=list(p.tensor.shape))
        written.pieces[p.key] = entry
    return written


def write_meta(directory: Path, meta: dict) -> WrittenFile:
    path = directory / META
    torch.save(meta, path)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    return WrittenFile(META, path.stat().st_size, file_digest(path))


TOKENIZER = "tokenizer.json"
CHAT_FILES = (CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE)  # the chat template and the special tokens it reads


def write_carried(directory: Path, files: dict[str, bytes]) -> list[WrittenFile]:
    """The small files that travel with the checkpoint (its tokenizer, its chat template: export and generation need
    them), written into the staging folder (published whole with the rest) and listed, so hashed, in the manifest."""
    written = []
    for name, data in sorted(files.items()):
        _write_bytes(directory / name, data)
        written.append(WrittenFile(name, len(data), xxhash.xxh64(data).hexdigest()))
    return written


def write_manifest(directory: Path, files: list[WrittenFile], info: dict) -> None:
    """The completion record: written after every rank's files exist, atomically (a temp file and a rename)."""
    tensors: dict[str, dict] = {}
    for written in files:
        for key, piece in written.pieces.items():
            entry = tensors.setdefault(key, {"shape": piece["global_shape"], "dtype": piece["dtype"], "pieces": []})
            if entry["shape"] != piece["global_shape"]:
                raise CheckpointError(
                    f"ranks disagree on the shape of {key}: {entry['shape']} vs {piece['global_shape']}"
                )
            location = (
                {"flat": piece["flat"]} if "flat" in piece else {"offsets": piece["offsets"], "shape": piece["shape"]}
            )
            entry["pieces"].append({"file": written.name, **location})
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        **info,
        "files": {f.name: {"size": f.size, "xxh64": f.xxh64} for f in files},
        "tensors": tensors,
    }
    with atomic_write(directory / MANIFEST, "wb", fsync=True) as handle:
        handle.write(json.dumps(manifest, indent=1, sort_keys=True).encode())


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint folder of this project (no {MANIFEST})")
    if not (path / MANIFEST).is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint: no {MANIFEST} (a save that did not finish, or not a checkpoint)"
        )
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise CheckpointError(f"{path / MANIFEST} is unreadable: {type(error).__name__}: {one_line(error)}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a {FORMAT_NAME} checkpoint")
    version = manifest.get("version", 0)
    if is_int(version) and version > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {version}; this version reads {FORMAT_VERSION}")
    check_manifest(path, manifest)  # types, file names, every tensor tiled exactly once
    return manifest


def verify_files(path: Path, manifest: dict, names: list[str] | None = None) -> str | None:
    """The first problem among `names` (default: every file of the manifest), or None: a missing file, a size
    that differs (truncated or grown), or a checksum that differs (altered)."""
    placed = pieces_by_file(manifest)
    for name in sorted(names if names is not None else manifest["files"]):
        expected = manifest["files"][name]
        file = Path(path) / name
        if file.is_symlink():  # never written by a save: it could lead anywhere
            return f"checkpoint file {file} is a symbolic link (a checkpoint holds its files itself)"
        if not file.is_file():
            return f"checkpoint file {file} is missing" if not file.exists() else f"{file} is not a regular file"
        size = file.stat().st_size
        if size != expected["size"]:
            return f"checkpoint file {file} has {size} bytes, the manifest says {expected['size']} (truncated?)"
        if file_digest(file) != expected["xxh64"]:
            return f"checkpoint file {file} does not match its checksum in the manifest (altered or corrupt)"
        problem = check_pieces_in_file(path, name, placed.get(name, []))  # the header agrees with the pieces
        if problem:
            return problem
    return None


def open_verified(path: Path) -> TensorReader:
    """A reader of a complete checkpoint whose every file matches its manifest (one-process use: tools, export)."""
    manifest = read_manifest(path)
    problem = verify_files(path, manifest)
    if problem is None:  # the tensors are those of the model the manifest describes
        problem = config_mismatch(manifest, config_of(manifest, f"{path}/{MANIFEST}"), "its model_config")
        problem = problem and f"checkpoint {path}: {problem}"
    if problem:
        raise CheckpointError(problem)
    return TensorReader(path, manifest)


def open_checked(path: Path) -> TensorReader:
    """A reader of a complete checkpoint whose manifest agrees with its model_config, each file checked against the
    manifest when first opened (a rank in a layout opens only the files holding its slices; checking every file
    would read every byte of the checkpoint on every rank)."""
    manifest = read_manifest(path)
    problem = config_mismatch(manifest, config_of(manifest, f"{path}/{MANIFEST}"), "its model_config")
    if problem:
        raise CheckpointError(f"checkpoint {path}: {problem}")
    return VerifyingReader(path, manifest)


def read_meta(path: Path, manifest: dict | None = None) -> dict:
    """meta.pt, tensors and plain types only (weights_only); with `manifest`, only if it lists (and so hashes) it.
    Lightning's checkpoint paths in it are confined to the folder holding the checkpoint (`check_meta`)."""
    file = Path(path) / META
    if manifest is not None and META not in manifest["files"]:
        raise CheckpointError(f"{path}: the manifest does not list {META}")
    try:
        meta = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - one line for any unreadable file
        raise CheckpointError(f"{file} is unreadable: {type(error).__name__}: {one_line(error)}") from None
    return check_meta(Path(path), meta)


def listed_tokenizer(path: Path, manifest: dict) -> Path | None:
    """The checkpoint's tokenizer, only if the manifest lists (and so hashes) it."""
    return Path(path) / TOKENIZER if TOKENIZER in manifest["files"] else None


def listed_chat(path: Path, manifest: dict) -> Path | None:
    """The checkpoint folder as the directory of its chat template and special tokens, only if the manifest lists
    the template; both files are checked against it now (they are small)."""
    if CHAT_TEMPLATE_FILE not in manifest["files"]:
        return None
    problem = verify_files(path, manifest, [name for name in CHAT_FILES if name in manifest["files"]])
    if problem:
        raise CheckpointError(problem)
    return Path(path)


class TensorReader:
    """Reads boxes of model-space tensors from a checkpoint's pieces (only the overlapping bytes)."""

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = Path(path), manifest
        self._open: dict[str, object] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.manifest["tensors"]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.manifest["tensors"][key]["shape"])

    def close(self) -> None:
        """Unmap the files read so far: pages touched through a mapping count as this process's memory."""
        self._open.clear()

    def _file(self, name: str):
        if name not in self._open:
            try:
                self._open[name] = safe_open(str(self.path / name), framework="pt", device="cpu")
            except Exception as error:  # noqa: BLE001 - a file changed since it was verified: one line
                raise CheckpointError(f"{self.path / name} is unreadable: {one_line(error)}") from None
        return self._open[name]

    def read(self, key: str, offsets=None, shape=None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The box [offsets, offsets + shape) of tensor `key` (default: all of it)."""
        entry = self.manifest["tensors"].get(key)
        if entry is None:
            raise CheckpointError(f"{self.path} holds no tensor {key}")
        full = tuple(entry["shape"])
        offsets = tuple(offsets) if offsets is not None else (0,) * len(full)
        shape = tuple(shape) if shape is not None else full
        out = torch.zeros(shape, dtype=dtype or getattr(torch, entry["dtype"]))
        covered = 0
        for piece in entry["pieces"]:
            if "flat" in piece:
                covered += self._read_flat(key, piece, full, offsets, out)
            else:
                covered += self._read_box(key, piece, offsets, shape, out)
        if covered < out.numel():
            raise CheckpointError(f"{self.path}: the pieces of {key} do not cover the box {offsets} + {shape}")
        return out

    def _read_box(self, key, piece, offsets, shape, out) -> int:
        lo = [max(o, po) for o, po in zip(offsets, piece["offsets"], strict=True)]
        hi = [
            min(o + s, po + ps) for o, s, po, ps in zip(offsets, shape, piece["offsets"], piece["shape"], strict=True)
        ]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return 0
        source = tuple(slice(a - po, b - po) for a, b, po in zip(lo, hi, piece["offsets"], strict=True))
        target = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))
        out[target] = self._file(piece["file"]).get_slice(key)[source]
        return int(torch.tensor([b - a for a, b in zip(lo, hi, strict=True)]).prod())

    def _read_flat(self, key, piece, full, offsets, out) -> int:
        """A flat range [start, start + n) of the row-major tensor into the box `out` (tensors seen as rows x cols:
        boxes here restrict the first dimension, or the second of a matrix)."""
        start, count = piece["flat"]
        cols = int(torch.tensor(full[1:]).prod()) if len(full) > 1 else 1
        r0, c0 = offsets[0], (offsets[1] if len(full) > 1 else 0)
        nr = out.shape[0]
        nc = out[0].numel() if out.numel() else 0
        first_row, last_row = max(r0, start // cols), min(r0 + nr, (start + count - 1) // cols + 1)
        if first_row >= last_row:
            return 0
        lo, hi = max(start, first_row * cols), min(start + count, last_row * cols)
        source = self._file(piece["file"]).get_slice(key)
        if nc == cols:  # whole rows: the box is itself a flat range
            out.view(-1)[lo - r0 * cols : hi - r0 * cols] = source[lo - start : hi - start].to(out.dtype)
            return hi - lo
        values = torch.zeros((last_row - first_row) * cols, dtype=out.dtype)
        mask = torch.zeros_like(values, dtype=torch.bool)
        values[lo - first_row * cols : hi - first_row * cols] = (
            self._file(piece["file"]).get_slice(key)[lo - start : hi - start].to(out.dtype)
        )
        mask[lo - first_row * cols : hi - first_row * cols] = True
        rows = out.view(nr, nc)[first_row - r0 : last_row - r0]
        values, mask = values.view(-1, cols)[:, c0 : c0 + nc], mask.view(-1, cols)[:, c0 : c0 + nc]
        rows[mask] = values[mask]
        return int(mask.sum())


class VerifyingReader(TensorReader):
    """A `TensorReader` that checks each file against the manifest (size, checksum, header) when it first opens it."""

    def __init__(self, path: Path, manifest: dict):
        super().__init__(path, manifest)
        self._checked: set[str] = set()

    def _file(self, name: str):
        if name not in self._checked:
            problem = verify_files(self.path, self.manifest, [name])
            if problem:
                raise CheckpointError(problem)
            self._checked.add(name)
        return super()._file(name)
