"""A checkpoint is checked before it is believed: the manifest's types, the files it names (plain names inside the
folder, listed with size and hash), every tensor's pieces tiling its shape exactly once, the shapes against the
model configuration, and each safetensors header against the pieces it holds -- all before any tensor is allocated.

Anchors: safetensors (header bounds checked before allocation) and Megatron-core's dist-checkpointing validation
(every element of every tensor covered exactly once). Every problem is one `CheckpointError` line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import warnings
from pathlib import Path

from mtnlg_lightning.config import ModelConfig, config_from_stored
from mtnlg_lightning.errors import MTNLGError, one_line
from mtnlg_lightning.model import build_model, persistent_buffers
from mtnlg_lightning.parallel.lora import stored_parameters
from mtnlg_lightning.parallel.muon import MOMENTUM_BUFFER

# The dtypes a checkpoint stores (manifest name -> safetensors name, bytes per element).
DTYPES = {"float32": ("F32", 4), "bfloat16": ("BF16", 2), "float16": ("F16", 2), "float64": ("F64", 8)}
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
MOMENTS = ("exp_avg", "exp_avg_sq")  # the optimizer state a checkpoint stores per parameter (AdamW)
STATE_KEYS = (*MOMENTS, MOMENTUM_BUFFER)  # ... and Muon's (`parallel/muon.py`), per matrix it steps
POSITIVE_INT_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "seq_len",
    "vocab_size",
    "ffn_hidden_size",
    "make_vocab_size_divisible_by",
    "max_position_embeddings",
    "num_kv_heads",
    "head_dim",
)
OPTIONAL_INT_FIELDS = ("ffn_hidden_size", "max_position_embeddings", "num_kv_heads", "head_dim")  # None: derived
BOOL_FIELDS = ("qk_norm", "bias", "tie_embeddings")


class CheckpointError(MTNLGError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, or of another model."""


def _error(message: str) -> CheckpointError:
    return CheckpointError(message)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value, what: str, minimum: int = 0) -> list[int]:
    if not isinstance(value, list) or not all(is_int(v) and v >= minimum for v in value):
        raise _error(f"{what} is {_short(value)}, expected a list of integers >= {minimum}")
    return value


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str | int | float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def plain_name(name, where: str) -> str:
    """A file name that stays inside its folder: no separators, no `..`, no NUL, not hidden-dot tricks."""
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise _error(f"{where} names the file {_short(name)}, which is not a plain file name inside the folder")
    return name


# ------------------------------------------------------------------------------------------------ manifest
def check_manifest(path: Path, manifest) -> None:
    """The manifest's structure, types, file names and tiling (no file is opened)."""
    where = f"{path}/manifest.json"
    if not isinstance(manifest, dict):
        raise _error(f"{where} is not a JSON object")
    version = manifest.get("version", 0)
    if not is_int(version):
        raise _error(f"{where}: version is {_short(version)}, expected an integer")
    for key in ("global_step", "consumed_samples"):
        if key in manifest and not (is_int(manifest[key]) and manifest[key] >= 0):
            raise _error(f"{where}: {key} is {_short(manifest[key])}, expected an integer >= 0")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise _error(f"{where}: 'files' is missing or not an object")
    for name, entry in files.items():
        plain_name(name, where)
        if not isinstance(entry, dict):
            raise _error(f"{where}: the entry of file {name} is not an object")
        if not (is_int(entry.get("size")) and entry["size"] >= 0):
            raise _error(f"{where}: file {name} has size {_short(entry.get('size'))}, expected an integer >= 0")
        digest = entry.get("xxh64")
        if not (isinstance(digest, str) and len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)):
            raise _error(f"{where}: file {name} has xxh64 {_short(digest)}, expected 16 hex digits")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict):
        raise _error(f"{where}: 'tensors' is missing or not an object")
    claimed: set = set()
    for key, entry in tensors.items():
        check_tensor(where, key, entry, files)
        for piece in entry["pieces"]:  # a file holds one tensor per key: two pieces cannot both be it
            if (piece["file"], key) in claimed:
                raise _error(f"{where}: two pieces of {key} name the same file {piece['file']}")
            claimed.add((piece["file"], key))
    if "model_config" in manifest:
        config_of(manifest, where)


def check_tensor(where: str, key: str, entry, files: dict) -> None:
    """One tensor's entry: shape, dtype, and pieces that lie inside it, in listed files, covering it exactly once."""
    if not isinstance(entry, dict):
        raise _error(f"{where}: the entry of tensor {key} is not an object")
    shape = _ints(entry.get("shape"), f"{where}: the shape of {key}")
    if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in DTYPES:
        raise _error(f"{where}: tensor {key} has dtype {_short(entry.get('dtype'))}; expected one of {list(DTYPES)}")
    pieces = entry.get("pieces")
    if not isinstance(pieces, list) or not pieces:
        raise _error(f"{where}: tensor {key} has no list of pieces")
    numel = math.prod(shape)
    boxes = []
    for piece in pieces:
        if not isinstance(piece, dict):
            raise _error(f"{where}: a piece of {key} is not an object")
        name = piece.get("file")
        if not isinstance(name, str) or name not in files:
            raise _error(f"{where}: a piece of {key} is in {_short(name)}, which is not among the listed files")
        if "flat" in piece:
            flat = _ints(piece["flat"], f"{where}: the flat range of a piece of {key}")
            if len(flat) != 2 or flat[0] + flat[1] > numel:
                raise _error(f"{where}: a piece of {key} has flat range {flat}, outside its {numel} elements")
            boxes += flat_boxes(flat[0], flat[0] + flat[1], tuple(shape))
        else:
            offsets = _ints(piece.get("offsets"), f"{where}: the offsets of a piece of {key}")
            size = _ints(piece.get("shape"), f"{where}: the shape of a piece of {key}")
            if len(offsets) != len(shape) or len(size) != len(shape):
                raise _error(
                    f"{where}: a piece of {key} has {len(offsets)}-d offsets and a {len(size)}-d shape for a "
                    f"{len(shape)}-d tensor"
                )
            if any(o + s > g for o, s, g in zip(offsets, size, shape, strict=True)):
                raise _error(f"{where}: a piece of {key} at {offsets} + {size} lies outside its shape {shape}")
            boxes.append((tuple(offsets), tuple(size)))
    problem = tiling_problem(boxes, tuple(shape))
    if problem:
        raise _error(f"{where}: the pieces of {key} {problem}")


def flat_boxes(start: int, end: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The row-major element range [start, end) of a tensor of `shape` as at most 2 * ndim boxes."""
    if end <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    row = math.prod(shape[1:])

    def in_row(index: int, lo: int, hi: int):
        return [((index, *o), (1, *s)) for o, s in flat_boxes(lo, hi, shape[1:])]

    first, last = start // row, (end - 1) // row
    if first == last:
        return in_row(first, start - first * row, end - first * row)
    out, whole_from, whole_to = [], first, last + 1
    if start % row:  # a partial first row
        out += in_row(first, start - first * row, row)
        whole_from = first + 1
    if end % row:  # a partial last row
        whole_to = last
    if whole_to > whole_from:
        out.append(((whole_from, *(0,) * (len(shape) - 1)), (whole_to - whole_from, *shape[1:])))
    if end % row:
        out += in_row(last, 0, end - last * row)
    return out


def tiling_problem(boxes, shape: tuple[int, ...]) -> str | None:
    """None if the boxes cover the tensor exactly once; else what is wrong (a gap or an overlap)."""
    boxes = [(o, s) for o, s in boxes if math.prod(s) > 0]
    total, numel = sum(math.prod(s) for _, s in boxes), math.prod(shape)
    if not shape:  # a scalar: one piece
        return None if len(boxes) == 1 else f"cover the scalar {len(boxes)} times"
    # Sweep along the first dimension: only boxes whose first-dimension ranges meet can overlap.
    boxes.sort(key=lambda b: b[0][0])
    active: list = []
    for offsets, size in boxes:
        active = [b for b in active if b[0][0] + b[1][0] > offsets[0]]
        for other_offsets, other_size in active:
            if all(
                max(a, b) < min(a + s, b + t)
                for a, s, b, t in zip(offsets, size, other_offsets, other_size, strict=True)
            ):
                return f"overlap at {list(offsets)} + {list(size)} and {list(other_offsets)} + {list(other_size)}"
        active.append((offsets, size))
    if total != numel:
        return f"cover {total} of its {numel} elements (a gap)"
    return None


def config_of(manifest: dict, where: str):
    """The manifest's `model_config` as a `ModelConfig`, its fields checked by type and range first."""
    values = manifest.get("model_config")
    if not isinstance(values, dict):
        raise _error(f"{where}: model_config is missing or not an object")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise _error(f"{where}: model_config has unknown field(s) {unknown}")
    for name in ("num_layers", "hidden_size", "num_heads", "seq_len"):
        if name not in values:
            raise _error(f"{where}: model_config has no {name}")
    for name in POSITIVE_INT_FIELDS:
        optional = name in OPTIONAL_INT_FIELDS and values.get(name, 1) is None
        if name in values and not optional and not (is_int(values[name]) and values[name] >= 1):
            raise _error(f"{where}: model_config.{name} is {_short(values[name])}, expected an integer >= 1")
    for name, low, high in (("hidden_dropout", 0, 1), ("attention_dropout", 0, 1), ("layernorm_eps", 0, 1)):
        value = values.get(name, 0.5)
        if not (isinstance(value, int | float) and not isinstance(value, bool) and low <= value < high):
            raise _error(f"{where}: model_config.{name} is {_short(value)}, expected a number in [{low}, {high})")
    std = values.get("init_std")
    if std is not None and not (isinstance(std, int | float) and not isinstance(std, bool) and 0 < std < math.inf):
        raise _error(f"{where}: model_config.init_std is {_short(std)}, expected a positive number")
    for name in ("name", "position_embedding", "norm", "mlp"):
        if not isinstance(values.get(name, ""), str):
            raise _error(f"{where}: model_config.{name} is not a string")
    if not isinstance(values.get("family", ""), str | None):
        raise _error(f"{where}: model_config.family is {_short(values['family'])}, expected a family's name or null")
    for name in (*BOOL_FIELDS, "qkv_bias"):
        value = values.get(name, True)
        if not isinstance(value, bool) and not (name == "qkv_bias" and value is None):
            raise _error(f"{where}: model_config.{name} is {_short(value)}, expected true or false")
    theta = values.get("rope_theta", 1.0)
    if not (isinstance(theta, int | float) and not isinstance(theta, bool) and 0 < theta < math.inf):
        raise _error(f"{where}: model_config.rope_theta is {_short(theta)}, expected a positive number")
    try:
        return config_from_stored(values)  # an earlier version's config (no family): its family from its options
    except MTNLGError as error:
        raise _error(f"{where}: model_config: {error}") from None


# ------------------------------------------------------------------------------------------------ model shapes
def expected_shapes(config, tensor_count: int, adapters: dict | None = None) -> dict[str, tuple[int, ...]]:
    """Model-space shapes of every parameter and persistent buffer of `config` (tied head left out, vocabulary
    unpadded), built on the meta device; a config claiming more layers than the manifest has tensors is refused
    before building. With `adapters` (the settings of a run that trained adapters), the parameters that train: the
    adapters (the base is frozen, not stored)."""
    if config.num_layers > tensor_count:
        raise _error(f"model_config says {config.num_layers} layers but the manifest has {tensor_count} tensors")
    try:  # meta tensors allocate nothing, but torch still refuses sizes past 2**63 bytes
        model = build_model(config, "meta")
    except (RuntimeError, OverflowError, ValueError) as error:
        raise _error(f"model_config describes a model that cannot be built ({one_line(error)})") from None
    try:
        expected = {name: tuple(p.shape) for name, p in stored_parameters(model, adapters).items()}
    except MTNLGError as error:
        raise _error(f"the checkpoint's adapter settings do not fit its model ({one_line(error)})") from None
    if adapters is None:  # an adapter run's buffers are its base's, as its frozen weights are
        expected |= {name: tuple(buffer.shape) for name, buffer in persistent_buffers(model)}
    for name in ("embed.wte.weight", "lm_head.weight"):
        if name in expected:
            expected[name] = (config.vocab_size, config.hidden_size)
    return expected


def config_mismatch(manifest: dict, config, subject: str = "this model") -> str | None:
    """The first tensor whose presence or shape disagrees with `config` (weights, fp32 masters, Adam moments)."""
    tensors = manifest["tensors"]
    expected = expected_shapes(config, len(tensors), manifest.get("lora"))
    stored = {k.removeprefix("model/"): tuple(v["shape"]) for k, v in tensors.items() if k.startswith("model/")}
    for name in sorted(set(expected) | set(stored)):
        if name not in stored:
            return f"the checkpoint has no tensor {name}, which {subject} has (another model shape?)"
        if name not in expected:
            return f"the checkpoint has a tensor {name} that {subject} does not have (another model shape?)"
        if stored[name] != expected[name]:
            shape = f"layers {config.num_layers}, hidden {config.hidden_size}, heads {config.num_heads}"
            return (
                f"{name} has shape {list(stored[name])}, but {subject} ({shape}, vocabulary {config.vocab_size}) "
                f"needs {list(expected[name])} (another model shape?)"
            )
    for key, entry in sorted(tensors.items()):
        kind, _, rest = key.partition("/")
        name, moment = (rest.rsplit("/", 1) + [""])[:2] if kind == "optim" else (rest, "")
        optim = kind == "optim" and name in expected and moment in STATE_KEYS
        known = (kind == "master" and name in expected) or optim
        if kind != "model" and not known:
            return f"the checkpoint has a tensor {key} that {subject} does not have"
        if kind != "model" and tuple(entry["shape"]) != expected[name]:
            return f"tensor {key} is {entry['shape']} in the checkpoint and {list(expected[name])} in {subject}"
    return None


# ------------------------------------------------------------------------------------------------ files
def safetensors_header(file: Path, size: int) -> dict:
    """The JSON header of a safetensors file, bounds-checked against the file's size (never trusted for memory)."""
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise _error(f"{file} is not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER, size - 8):
            raise _error(f"{file} has a safetensors header of {length} bytes, longer than the file allows")
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as error:
        raise _error(f"{file} has an unreadable safetensors header ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise _error(f"{file} has a safetensors header that is not an object")
    data = size - 8 - length
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise _error(f"{file}: the header entry of {key} is not an object")
        span = info.get("data_offsets")
        shape = info.get("shape")
        itemsize = {v[0]: v[1] for v in DTYPES.values()}.get(info.get("dtype"), 1)
        if not (isinstance(span, list) and len(span) == 2 and all(is_int(v) for v in span)):
            raise _error(f"{file}: {key} has no valid data_offsets")
        if not (isinstance(shape, list) and all(is_int(v) and v >= 0 for v in shape)):
            raise _error(f"{file}: {key} has no valid shape")
        if not (0 <= span[0] <= span[1] <= data) or span[1] - span[0] != math.prod(shape) * itemsize:
            raise _error(f"{file}: {key} has data_offsets {span} that do not fit its shape {shape} in the file")
        spans.append(span)
    end = 0
    for start, stop in sorted(spans):  # the tensors' bytes tile the data area, as the format requires
        if start != end:
            raise _error(f"{file}: the tensors' data_offsets leave a gap or overlap at byte {min(start, end)}")
        end = stop
    if end != data:
        raise _error(f"{file}: the tensors' data_offsets end at byte {end} of a {data}-byte data area")
    return header


def pieces_by_file(manifest: dict) -> dict[str, list[tuple[str, str, dict]]]:
    """file name -> [(tensor key, dtype, piece)] of the pieces the manifest places in it."""
    out: dict[str, list] = {}
    for key, entry in manifest["tensors"].items():
        for piece in entry["pieces"]:
            out.setdefault(piece["file"], []).append((key, entry["dtype"], piece))
    return out


def check_pieces_in_file(path: Path, name: str, wanted: list[tuple[str, str, dict]]) -> str | None:
    """Every piece placed in file `name` (`wanted`, from `pieces_by_file`) is there, with the manifest's dtype and
    the piece's shape, and the file holds nothing else."""
    if not wanted:
        return None
    file = Path(path) / name
    try:
        header = safetensors_header(file, file.stat().st_size)
    except MTNLGError as error:
        return str(error)
    unclaimed = sorted(set(header) - {key for key, _, _ in wanted} - {"__metadata__", "__empty__"})
    if unclaimed:
        return f"checkpoint file {file} holds {unclaimed[0]}, which no piece of the manifest names"
    for key, dtype, piece in wanted:
        info = header.get(key)
        shape = [piece["flat"][1]] if "flat" in piece else piece["shape"]
        if not isinstance(info, dict):
            return f"checkpoint file {file} does not hold {key}, which the manifest places there"
        if info.get("dtype") != DTYPES[dtype][0] or info.get("shape") != shape:
            return (
                f"checkpoint file {file} holds {key} as {info.get('dtype')} {info.get('shape')}, the manifest says "
                f"{dtype} {shape}"
            )
    return None


# ------------------------------------------------------------------------------------------------ meta.pt
CALLBACK_PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")


def check_meta(path: Path, meta) -> dict:
    """meta.pt's types where the loaders use them; Lightning's checkpoint paths confined to the folder holding the
    checkpoint (Lightning deletes earlier top-k / last checkpoints by these paths)."""
    where = f"{path}/meta.pt"
    if not isinstance(meta, dict):
        raise _error(f"{where} is not a dictionary")
    hparams = meta.get("hyper_parameters")
    if hparams is not None and not isinstance(hparams, dict):
        raise _error(f"{where}: hyper_parameters is not a dictionary")
    optimizer = meta.get("optimizer")
    if optimizer is not None:
        groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
        if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" not in g for g in groups):
            raise _error(f"{where}: optimizer.param_groups is not a list of hyper-parameter dictionaries")
        step = optimizer.get("step")
        if step is not None and not (isinstance(step, int | float) and not isinstance(step, bool) and step >= 0):
            raise _error(f"{where}: optimizer.step is {_short(step)}, expected a number >= 0")
    callbacks = meta.get("callbacks")
    if callbacks is not None and not isinstance(callbacks, dict):
        raise _error(f"{where}: callbacks is not a dictionary")
    home = Path(path).resolve().parent
    for state_key, state in (callbacks or {}).items():
        if isinstance(state, dict) and _points_outside(state, home):
            # A checkpoint copied or moved from elsewhere (or a hostile one): Lightning would later delete its
            # "earlier" top-k / last checkpoints by these paths. Keep none of them; training itself is unaffected.
            for key in ("best_k_models", "kth_best_model_path", "kth_value", "last_model_path"):
                state.pop(key, None)
            state["best_model_path"] = ""
            warnings.warn(
                f"{where}: callback state {str(state_key)[:40]} names checkpoints outside {home}; "
                "its top-k and last-checkpoint paths are not restored",
                stacklevel=2,
            )
    return meta


def _points_outside(state: dict, home: Path) -> bool:
    """Whether a callback's saved checkpoint paths lie anywhere but directly in `home`."""
    named = [state.get(k) for k in CALLBACK_PATHS]
    best_k = state.get("best_k_models")
    if best_k is not None and not isinstance(best_k, dict):
        return True
    named += list(best_k or {})
    for value in named:
        if value in (None, ""):
            continue
        if not isinstance(value, str) or Path(value).resolve().parent != home:
            return True
    return False
