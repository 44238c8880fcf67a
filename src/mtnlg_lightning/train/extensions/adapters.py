"""LoRA (`--model.lora`) as an extension: the adapters go on the frozen `init_from` model with the layout
(`parallel/lora.py`), checkpoints store the adapters only and name the base by path and content hash
(`interop/lora_base.py`), and a resume checks that it trains on the same base."""

from __future__ import annotations

import dataclasses

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.interop.lora_base import LORA_BASE, base_reference, check_base
from mtnlg_lightning.parallel.lora import LoRAConfig
from mtnlg_lightning.train.extensions.extension import Extension


class LowRankAdapters(Extension):
    frozen_base = True

    def __init__(self, settings: LoRAConfig, config, init_from: str | None):
        settings.projections(config)  # a target the model lacks is one line now
        if not init_from:
            raise MTNLGError("model.lora needs model.init_from: the model directory the adapter trains on")
        self.settings = settings
        self.base = base_reference(init_from)  # the base the adapter trains on: {path, content}

    def model_transforms(self) -> dict:
        return {"lora": self.settings}

    def manifest_entries(self) -> dict:
        # the stored tensors are the adapters of these settings (the frozen base is not stored)
        return {"lora": dataclasses.asdict(self.settings)}

    def on_save_checkpoint(self, module, checkpoint: dict) -> None:
        checkpoint[LORA_BASE] = self.base

    def on_load_checkpoint(self, module, checkpoint: dict) -> None:
        if checkpoint.get(LORA_BASE) is not None:
            check_base(checkpoint[LORA_BASE], self.base)
