"""The base of a LoRA run: named by path and content hash in its checkpoints, checked when the adapter meets it
again (a resume, an export, generation), and merged with the adapter into model-space weights.

The content hash is xxh3-128 over the files that hold the base's weights and architecture (`config.json`, the
safetensors or `.bin` files and their index; of a project checkpoint, its manifest, which records every file's
xxh64), in name order with each name and size: reading the files once, at disk speed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import xxhash

from mtnlg_lightning.checkpoint.model_state import LORA_BASE, LazyWeights, ModelState, as_lazy
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.parallel.lora import adapter_names, lora_config, lora_delta

__all__ = ["LORA_BASE", "base_path", "base_reference", "check_base", "with_base"]

WEIGHT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")


def _content_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if (path / "manifest.json").is_file():  # a project checkpoint: its manifest holds every file's checksum
        return [path / "manifest.json"]
    files = sorted({f for pattern in WEIGHT_FILES for f in path.glob(pattern) if f.is_file()})
    if not files:
        raise MTNLGError(f"{path} holds no model files (config.json, *.safetensors, pytorch_model.bin)")
    return files


def content_hash(path: str | Path, chunk: int = 1 << 24) -> str:
    digest = xxhash.xxh3_128()
    for file in _content_files(Path(path)):
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as handle:
            while block := handle.read(chunk):
                digest.update(block)
    return digest.hexdigest()


def base_reference(path: str | Path) -> dict:
    """{path, content}: what a LoRA checkpoint records of the model its adapter trains on."""
    if not Path(path).exists():
        raise MTNLGError(f"the LoRA base {path} does not exist")
    return {"path": str(Path(path).resolve()), "content": content_hash(path)}


def check_base(recorded: dict, found: dict) -> None:
    """One line unless `found` (a base reference) has the content the adapter was trained on."""
    if recorded.get("content") != found.get("content"):
        raise MTNLGError(
            f"{found.get('path')} is a base directory whose content differs from the one the adapter was trained on "
            f"({recorded.get('path')}, content {str(recorded.get('content'))[:12]}..., here "
            f"{str(found.get('content'))[:12]}...)"
        )


class MergedWeights(LazyWeights):
    """The base's model-space weights with each adapted weight replaced by W + s B A (fp32), computed when read."""

    def __init__(self, base: LazyWeights, adapters, lora, config):
        super().__init__(base)
        self.base, self.adapters, self.scale = base, adapters, lora.scale
        self.merged = {weight: module for module, weight in adapter_names(config, lora).items()}
        missing = [m for m in self.merged.values() if f"{m}.lora_a" not in adapters or f"{m}.lora_b" not in adapters]
        if missing:
            raise MTNLGError(f"the checkpoint has no adapter for {missing[0]}, which its LoRA settings target")

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        weight = self.base[name]
        module = self.merged.get(name)
        if module is None:
            return weight
        delta = lora_delta(self.adapters[f"{module}.lora_a"], self.adapters[f"{module}.lora_b"], self.scale)
        return (weight.to(delta.dtype) + delta).to(weight.dtype)


def with_base(adapter: ModelState, base: ModelState) -> ModelState:
    """A LoRA checkpoint's model: its base (checked against the recorded content hash) with the adapters merged."""
    check_base(adapter.base, base_reference(base_path(adapter)))
    shaped = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size", "mlp")
    shaped += ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim")  # multi-head latent attention
    theirs, ours = dataclasses.asdict(base.config), dataclasses.asdict(adapter.config)
    different = [f for f in shaped if theirs[f] != ours[f]]
    if different:
        raise MTNLGError(f"the LoRA base {adapter.base['path']} is another model ({different[0]} differs)")
    lora = lora_config(adapter.lora)
    merged = MergedWeights(as_lazy(base.weights), adapter.weights, lora, adapter.config)
    tokenizer, chat = adapter.tokenizer or base.tokenizer, adapter.chat or base.chat
    return ModelState(adapter.config, merged, adapter.hparams, tokenizer, chat=chat)


def base_path(adapter: ModelState) -> str:
    """Where the base of a LoRA checkpoint was when it trained."""
    if adapter.base is None:
        raise MTNLGError("the LoRA checkpoint names no base (no lora_base entry)")
    return adapter.base["path"]
