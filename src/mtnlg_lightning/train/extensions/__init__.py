"""The extensions a run's model and config declare (`extension.Extension`)."""

from __future__ import annotations

from collections.abc import Mapping

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.parallel.lora import lora_config
from mtnlg_lightning.train.extensions.adapters import LowRankAdapters
from mtnlg_lightning.train.extensions.extension import Extension
from mtnlg_lightning.train.extensions.mixture_of_experts import RouterBalancing
from mtnlg_lightning.train.extensions.multi_token_prediction import MultiTokenPredictionLosses
from mtnlg_lightning.train.extensions.qk_clip import QKClipping


def extensions_for(config, hparams: Mapping) -> list[Extension]:
    """The extensions of a model (`config`) and the module's settings (`hparams`): LoRA where `model.lora` is set
    (first: it transforms the model the others see), then multi-token prediction where `model.mtp_layers` is set
    (before mixture of experts, whose router losses then wrap the main and MTP losses once), then mixture of experts
    where the model has MoE layers, then QK-clip where `model.qk_clip` is set."""
    lora = lora_config(hparams.get("lora"))
    extensions: list[Extension] = []
    if lora is not None:
        extensions.append(LowRankAdapters(lora, config, hparams.get("init_from")))
    if config.mtp_layers:
        objective = hparams.get("objective", "lm")
        if objective != "lm":  # DPO and GRPO score sequences: the depths' next-next tokens are no part of them
            raise MTNLGError(
                f"multi-token prediction (model.mtp_layers {config.mtp_layers}) trains with the lm objective, not "
                f"{objective!r}: set model.mtp_layers to 0"
            )
        extensions.append(MultiTokenPredictionLosses(config))
    if config.moe:
        extensions.append(RouterBalancing(config, frozen_base=lora is not None))
    if hparams.get("qk_clip") is not None:
        extensions.append(QKClipping(config, float(hparams["qk_clip"])))
    return extensions
