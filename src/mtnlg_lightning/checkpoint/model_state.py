"""Weights of a checkpoint in model space, whatever layout wrote it: for export, generation and evaluation."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from mtnlg_lightning.checkpoint.format import (
    MANIFEST,
    META,
    listed_chat,
    listed_tokenizer,
    open_checked,
    open_verified,
    read_meta,
    verify_files,
)
from mtnlg_lightning.checkpoint.validate import CheckpointError, config_of
from mtnlg_lightning.config import ModelConfig, stored_preset_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.model import persistent_buffers


@dataclass
class ModelState:
    """A model as a checkpoint holds it.

    weights: single-process parameter names of `GPT` (`embed.wte.weight`, `blocks.0.attn.qkv.weight`, ...), the
        tied `lm_head.weight` left out, the word embedding trimmed to `config.vocab_size` rows (no padding). A
        mapping: a dict, or `LazyWeights` reading each tensor from disk when it is looked up (big models).
    hparams: the `MTNLGModule` init arguments (preset, model_overrides, recipe).
    tokenizer: the tokenizer file or directory saved with the run, if any.
    lora: a LoRA run's settings (`parallel/lora.py`): `weights` are then its adapters only
        (`blocks.N.attn.q.lora_a`, ...), and `base` names the model they adapt: {path, content}.
    chat: the directory of the model's chat template and the special tokens it reads (chat_template.jinja or
        tokenizer_config.json, as `data.chat_template.ChatTokenizer` reads them): a Hugging Face directory, or a
        checkpoint folder whose manifest lists them; None when the source carries none.
    """

    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    hparams: dict
    tokenizer: Path | None = None
    lora: dict | None = None
    base: dict | None = None
    chat: Path | None = None


LORA_BASE = "lora_base"  # the checkpoint entry (meta) naming a LoRA run's base: {path, content}
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")


class LazyWeights(Mapping):
    """Model-space weights read from disk one tensor at a time when looked up, never all at once: iterating and
    `shape` touch no tensor data; `read_box` reads part of a tensor (exporting one bigger than memory allows)."""

    def __init__(self, names: Collection[str] = ()):
        self.names = names  # the weights served, in their order
        self._last: tuple[str, torch.Tensor] | None = None  # `read_box` slices of one tensor read it once

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self[name].shape)

    def read_box(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The box [offsets, offsets + shape) of a tensor; here by slicing the whole tensor (kept for the next
        box of the same tensor). Sources that can read boxes directly override this."""
        if self._last is None or self._last[0] != name:
            self._last = None  # let the previous tensor go before reading the next
            self._last = (name, self[name])
        return self._last[1][tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))]


class DictWeights(LazyWeights):
    """Weights already in memory, seen through the `LazyWeights` interface."""

    def __init__(self, weights: Mapping[str, torch.Tensor]):
        super().__init__(weights)
        self.weights = weights

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.weights[name]


def as_lazy(weights: Mapping[str, torch.Tensor]) -> LazyWeights:
    return weights if isinstance(weights, LazyWeights) else DictWeights(weights)


class CheckpointWeights(LazyWeights):
    """The model-space weights of a checkpoint folder, read piece by piece from its safetensors files (the fp32
    master copy where the checkpoint has one and `master`). Each read unmaps the files it touched, so the pages
    read stay in the page cache and out of this process's resident memory."""

    def __init__(self, reader, master: bool = True):
        self.reader = reader
        self._keys = {}
        for key in sorted(reader.manifest["tensors"]):
            if key.startswith("model/"):
                name = key.removeprefix("model/")
                self._keys[name] = f"master/{name}" if master and f"master/{name}" in reader else key
        super().__init__(self._keys)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read_box(name, None, None)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(self._keys[name])

    def read_box(self, name: str, offsets, shape) -> torch.Tensor:
        key = self._keys.get(name)
        if key is None:
            raise KeyError(name)
        try:
            return self.reader.read(key, offsets, shape)
        finally:
            self.reader.close()


def model_space(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Drop a tied head (it is the embedding) and the vocabulary padding (it depends on the TP degree that wrote
    it)."""
    out = {k: v for k, v in weights.items() if k != "lm_head.weight" or not config.tie_embeddings}
    for name in ("embed.wte.weight", "lm_head.weight"):
        if name in out:
            out[name] = out[name][: config.vocab_size]
    return out


def _read_lightning_file(path: Path) -> ModelState:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one line for the user
        raise MTNLGError(f"{path} is not a readable checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise MTNLGError(f"{path} is not a checkpoint of this project (no state_dict)")
    hparams = dict(ckpt.get("hyper_parameters") or {})
    config = stored_preset_config(hparams.get("preset", "tiny"), hparams.get("model_overrides") or {})
    weights = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    tokenizer = (ckpt.get("datamodule_hyper_parameters") or {}).get("tokenizer")
    lora = hparams.get("lora")
    if lora is not None:  # the adapters; the frozen base comes from the directory the run names
        weights = {k: v for k, v in weights.items() if k.endswith(ADAPTER_SUFFIXES)}
    tokenizer = Path(tokenizer) if tokenizer else None
    return ModelState(config, model_space(weights, config), hparams, tokenizer, lora, ckpt.get(LORA_BASE))


def _read_folder(path: Path, master: bool, verify: str) -> ModelState:
    # every file listed, tiled and of the shapes of its model_config; hashed now ("all") or when first read
    reader = open_verified(path) if verify == "all" else open_checked(path)
    manifest = reader.manifest
    if verify != "all":
        problem = verify_files(path, manifest, [META])
        if problem:
            raise CheckpointError(problem)
    config = config_of(manifest, f"{path}/{MANIFEST}")
    weights = CheckpointWeights(reader, master)
    meta = read_meta(path, manifest)
    hparams = dict(meta.get("hyper_parameters") or {})
    tokenizer = listed_tokenizer(path, manifest)
    chat = listed_chat(path, manifest)
    return ModelState(config, weights, hparams, tokenizer, manifest.get("lora"), meta.get(LORA_BASE), chat)


def read_model_state(path: str | Path, master: bool = True, verify: str = "all") -> ModelState:
    """Model-space weights of a checkpoint folder of any layout (checked against its manifest first), or of a
    Lightning `.ckpt` file; `master`: the fp32 master weights where the checkpoint has them. `verify`: "all" hashes
    every file of a folder now; "opened" each file when it is first read (a rank of a layout reads a few). Errors
    are one `MTNLGError` line."""
    path = Path(path)
    if not path.exists():
        raise MTNLGError(f"checkpoint {path} does not exist")
    if path.is_file():
        return _read_lightning_file(path)
    return _read_folder(path, master, verify)


@torch.no_grad()
def load_model_space(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy model-space weights into a full single-process `GPT` (before any strategy shards it). The vocabulary
    rows past the source's (padding for the layout) are zeroed: no token maps to them. `weights` may be lazy
    (`LazyWeights`): each tensor is read when its parameter is filled, then let go."""
    # A tied head is the embedding's parameter: named once. Persistent buffers (a sigmoid router's bias) load too; a
    # source without them (a Hugging Face directory: its routers have none) leaves them at their initial values.
    names = set(weights)  # iterating a lazy mapping reads no tensor; `in` on it would
    buffers = {name: buffer for name, buffer in persistent_buffers(model) if name in names}
    params = {**dict(model.named_parameters()), **buffers}
    missing, unexpected = sorted(set(params) - names), sorted(names - set(params))
    if missing or unexpected:
        raise MTNLGError(f"weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, param in params.items():
        source = weights[name]
        vocabulary = name in ("embed.wte.weight", "lm_head.weight")
        if vocabulary and source.shape[0] <= param.shape[0] and source.shape[1:] == param.shape[1:]:
            param[source.shape[0] :].zero_()
            param[: source.shape[0]].copy_(source)
        elif source.shape != param.shape:
            raise MTNLGError(f"{name}: the source has shape {tuple(source.shape)}, the model {tuple(param.shape)}")
        else:
            param.copy_(source)
