"""Fuzz the checkpoint reader: seeded mutations of a real (tiny) checkpoint, each either loading exactly the
original tensors or failing with one `MTNLGError` line -- never a traceback, never silent zeros, never a read
outside the checkpoint folder.

    python benchmarks/fuzz_checkpoint.py --cases 5000 --seed 0     # the long run (`run` here, 5000 cases)

The checkpoint is written by the same functions a training save uses (`write_pieces`, `write_meta`,
`write_manifest`): bf16 weights in boxes split over two rank files (as tensor parallelism writes them), fp32 master
weights, Adam moments as flat fragments cut mid-row (as ZeRO-1/2 writes them), meta.pt and a listed tokenizer.
Mutations: manifest fields (replaced, deleted, given another type), piece boxes and flat ranges, file names and
links (paths out of the folder), safetensors headers, truncations and flipped bytes -- some re-hashed in the
manifest as a hostile file would be, so the checks behind the checksum are exercised too. Tests run a few hundred
cases of the same generator (tests/test_checkpoint_trust.py).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import struct
import sys
import time
from pathlib import Path

import torch
import xxhash

from mtnlg_lightning.checkpoint.format import (
    MANIFEST,
    TOKENIZER,
    Piece,
    WrittenFile,
    open_verified,
    read_meta,
    write_manifest,
    write_meta,
    write_pieces,
)
from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError

CONFIG = dict(num_layers=1, hidden_size=8, num_heads=2, seq_len=4, vocab_size=12)
ODD_VALUES = [None, -1, 0, 1, 2**62, 1.5, True, "x", "../outside.safetensors", "/etc/passwd", [], {}, [1], [-1, 0]]


def make_checkpoint(folder: Path, outside: Path) -> dict[str, torch.Tensor]:
    """A real checkpoint of a 1-layer model in `folder`; a valid copy of a rank file is planted at `outside` (a
    path the mutations point at: reading it would load plausible tensors). Returns every tensor by key."""
    from mtnlg_lightning.model import build_model

    torch.manual_seed(0)
    config = ModelConfig(**CONFIG)
    model = build_model(config)
    originals: dict[str, torch.Tensor] = {}
    rank_pieces: list[list[Piece]] = [[], []]
    for name, param in model.named_parameters():
        if name == "lm_head.weight":
            continue
        full = param.detach()[: config.vocab_size] if name == "embed.wte.weight" else param.detach()
        weight, master = full.to(torch.bfloat16), full.float()
        originals[f"model/{name}"], originals[f"master/{name}"] = weight, master
        cut = full.shape[0] // 2  # two "tensor-parallel" row boxes
        for rank, (lo, hi) in enumerate([(0, cut), (cut, full.shape[0])]):
            offsets = (lo,) + (0,) * (full.dim() - 1)
            rank_pieces[rank].append(Piece(f"model/{name}", weight[lo:hi].clone(), offsets, tuple(full.shape)))
        rank_pieces[0].append(Piece(f"master/{name}", master.clone(), (0,) * full.dim(), tuple(full.shape)))
        for moment in ("exp_avg", "exp_avg_sq"):
            value = torch.randn(full.shape)
            originals[f"optim/{name}/{moment}"] = value
            flat, split = value.flatten(), max(1, value.numel() // 2 - 1)  # mid-row, as ZeRO fragments are
            for rank, (lo, hi) in enumerate([(0, split), (split, value.numel())]):
                piece = Piece(f"optim/{name}/{moment}", flat[lo:hi].clone(), (), tuple(full.shape), flat_start=lo)
                rank_pieces[rank].append(piece)
    folder.mkdir(parents=True)
    files = [write_pieces(folder, f"rank-{r:05d}.safetensors", p) for r, p in enumerate(rank_pieces)]
    files.append(write_meta(folder, {"global_step": 3, "hyper_parameters": {"preset": "tiny"}, "optimizer": None}))
    tokenizer = b'{"model": {"type": "WordLevel"}}'
    (folder / TOKENIZER).write_bytes(tokenizer)
    files.append(WrittenFile(TOKENIZER, len(tokenizer), xxhash.xxh64(tokenizer).hexdigest()))
    info = {"global_step": 3, "consumed_samples": 12, "model_config": dict(CONFIG)}
    write_manifest(folder, files, info)
    shutil.copy(folder / "rank-00000.safetensors", outside)
    return originals


# ------------------------------------------------------------------------------------------------ mutations
def _rehash(folder: Path, manifest: dict, name: str) -> None:
    """What a hostile editor would do: make the manifest's size and checksum match the altered file."""
    data = (folder / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "xxh64": xxhash.xxh64(data).hexdigest()}


def _leaves(node, trail=()):
    """Every (path, value) in a JSON tree, containers included."""
    yield trail, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        yield from _leaves(value, (*trail, key))


def _set(tree, trail, value) -> None:
    for key in trail[:-1]:
        tree = tree[key]
    tree[trail[-1]] = value


def _delete(tree, trail) -> None:
    for key in trail[:-1]:
        tree = tree[key]
    del tree[trail[-1]]


def _pieces(manifest: dict) -> list[dict]:
    return [p for entry in manifest["tensors"].values() for p in entry["pieces"]]


def _rewrite_header(file: Path, rng: random.Random) -> None:
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    key = rng.choice(sorted(k for k in header if k != "__metadata__"))
    field = rng.choice(["dtype", "shape", "data_offsets", "delete", "length"])
    if field == "length":
        new_length = rng.choice([0, length - 1, length + 1, 2**40, len(data)])
        file.write_bytes(struct.pack("<Q", new_length) + data[8:])
        return
    if field == "delete":
        del header[key]
    elif field == "dtype":
        header[key]["dtype"] = rng.choice(["F16", "BF16", "F64", "I64", "U8", "Q9"])
    elif field == "shape":
        shape = list(header[key]["shape"])
        shape = rng.choice([shape[::-1], shape + [1], [math.prod(shape)], [s + 1 for s in shape], [2**40]])
        header[key]["shape"] = shape
    else:
        span = list(header[key]["data_offsets"])
        span[rng.randrange(2)] += rng.choice([-4, -2, 2, 4, 2**40])
        header[key]["data_offsets"] = span
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def mutate(folder: Path, outside: Path, rng: random.Random) -> str:
    """Apply one seeded mutation to the checkpoint in `folder`; returns what it did (for a failure report)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    files = sorted(manifest["files"])
    kind = rng.choice(
        ["field", "field", "delete", "piece", "piece", "path", "link", "header", "truncate", "flip", "flip-manifest"]
    )
    rehash = rng.random() < 0.5
    what = kind
    if kind == "field":
        trail, _ = rng.choice(list(_leaves(manifest))[1:])
        value = rng.choice(ODD_VALUES)
        _set(manifest, trail, value)
        what = f"set {list(trail)} = {value!r}"
    elif kind == "delete":
        trail, _ = rng.choice(list(_leaves(manifest))[1:])
        _delete(manifest, trail)
        what = f"delete {list(trail)}"
    elif kind == "piece":
        piece = rng.choice(_pieces(manifest))
        field = "flat" if "flat" in piece else rng.choice(["offsets", "shape"])
        index = rng.randrange(len(piece[field]))
        piece[field][index] += rng.choice([-2, -1, 1, 2, 2**40])
        if rng.random() < 0.3:  # and a duplicate or a dropped piece
            entry = next(e for e in manifest["tensors"].values() if piece in e["pieces"])
            entry["pieces"].append(dict(piece)) if rng.random() < 0.5 else entry["pieces"].remove(piece)
        what = f"piece {field}[{index}] -> {piece}"
    elif kind == "path":
        piece = rng.choice(_pieces(manifest))
        name = rng.choice([f"../{outside.name}", str(outside), f"sub/../../{outside.name}", "./rank-00000.safetensors"])
        if rng.random() < 0.5:  # listed too, with the outside file's true size and hash
            data = outside.read_bytes()
            manifest["files"][name] = {"size": len(data), "xxh64": xxhash.xxh64(data).hexdigest()}
        piece["file"] = name
        what = f"piece file -> {name}"
    elif kind == "link":
        name = rng.choice(files)
        (folder / name).unlink()
        (folder / name).symlink_to(outside)
        if rehash:
            _rehash(folder, manifest, name)
        what = f"{name} -> link to outside"
    elif kind == "header":
        name = rng.choice([f for f in files if f.endswith(".safetensors")])
        _rewrite_header(folder / name, rng)
        if rehash:
            _rehash(folder, manifest, name)
        what = f"header of {name}"
    elif kind == "truncate":
        name = rng.choice(files)
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: rng.randrange(len(data))])
        if rehash:
            _rehash(folder, manifest, name)
        what = f"truncate {name}"
    elif kind == "flip":  # a flipped byte is caught by the checksum (not re-hashed: the data would be new data)
        name = rng.choice(files)
        data = bytearray((folder / name).read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        (folder / name).write_bytes(bytes(data))
        what = f"flip a byte of {name}"
    if kind == "flip-manifest":  # the manifest itself has no checksum: a flipped byte must still never pass wrongly
        raw = bytearray((folder / MANIFEST).read_bytes())
        position = rng.randrange(len(raw))
        raw[position] ^= 1 << rng.randrange(8)
        (folder / MANIFEST).write_bytes(bytes(raw))
        return f"flip manifest byte {position}"
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return what + (" (re-hashed)" if rehash and kind in ("link", "header", "truncate") else "")


# ------------------------------------------------------------------------------------------------ the oracle
class OutsideReads:
    """Records every file opened under `root` but outside `folder` (an audit hook: it sees every `open`)."""

    def __init__(self):
        self.root, self.folder, self.seen = None, None, []
        sys.addaudithook(self._hook)

    def _hook(self, event, args):
        if event != "open" or self.root is None or not isinstance(args[0], str | bytes | Path):
            return
        path = Path(args[0] if not isinstance(args[0], bytes) else args[0].decode(errors="replace"))
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError):
            return
        if resolved.is_relative_to(self.root) and not resolved.is_relative_to(self.folder):
            self.seen.append(str(path))


def load_everything(folder: Path) -> dict[str, torch.Tensor]:
    """What the tools read from a checkpoint: the verified manifest, every tensor, meta.pt."""
    reader = open_verified(folder)
    out = {key: reader.read(key) for key in reader.manifest["tensors"]}
    read_meta(folder, reader.manifest)
    return out


def check_case(folder: Path, originals: dict, watcher: OutsideReads) -> tuple[str, str | None]:
    """("loaded" or "refused", None) if the case behaved; else ("failed", what went wrong)."""
    watcher.seen.clear()
    try:
        loaded = load_everything(folder)
    except MTNLGError as error:
        message = str(error)
        if not message or "\n" in message:
            return "failed", f"an error that is not one line: {message!r}"
        outcome = "refused"
    except Exception as error:  # noqa: BLE001 - exactly what the fuzzer looks for
        import traceback

        return "failed", f"traceback: {type(error).__name__}: {error}\n{traceback.format_exc()}"
    else:
        if sorted(loaded) != sorted(originals):
            return "failed", f"loaded other tensors: {sorted(set(loaded) ^ set(originals))[:3]}"
        for key, value in originals.items():
            if loaded[key].dtype != value.dtype or not torch.equal(loaded[key], value):
                return "failed", f"loaded {key} with other values (silent corruption)"
        outcome = "loaded"
    if watcher.seen:
        return "failed", f"read outside the checkpoint folder: {watcher.seen[0]}"
    return outcome, None


def run(cases: int, seed: int, workdir: Path, progress: bool = False) -> dict:
    """Run `cases` mutations; returns counts (loaded, refused, failures with their first few descriptions)."""
    workdir.mkdir(parents=True, exist_ok=True)
    pristine, outside = workdir / "pristine", workdir / "outside.safetensors"
    originals = make_checkpoint(pristine, outside)
    watcher = OutsideReads()
    watcher.root, watcher.folder = workdir.resolve(), (workdir / "case").resolve()
    counts, failures = {"loaded": 0, "refused": 0, "failed": 0}, []
    started = time.perf_counter()
    try:
        for index in range(cases):
            rng = random.Random(f"{seed}-{index}")
            case = workdir / "case"
            if case.exists():
                shutil.rmtree(case)
            shutil.copytree(pristine, case, symlinks=True)
            what = mutate(case, outside, rng)
            outcome, problem = check_case(case, originals, watcher)
            counts[outcome] += 1
            if problem:
                failures.append(f"case {index} ({what}): {problem}")
            if progress and (index + 1) % 500 == 0:
                print(f"  {index + 1}/{cases} cases, {len(failures)} failures", file=sys.stderr)
    finally:
        watcher.root = None
    return {**counts, "cases": cases, "failures": failures, "seconds": time.perf_counter() - started}
