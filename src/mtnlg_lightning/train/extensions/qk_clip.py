"""QK-clip as an extension (`parallel/qk_clip.py`): the step's per-head maximum attention logits recorded in the
forward, reduced over the world after the update and the heads over tau scaled back; `qk_max_logit/LAYER` (the
largest over the layer's heads, before the clip) and `qk_clipped_heads` (the query heads over tau) logged each step."""

from __future__ import annotations

from torch import nn

from mtnlg_lightning.parallel.qk_clip import QKClip
from mtnlg_lightning.train.extensions.extension import Extension


class QKClipping(Extension):
    def __init__(self, config, tau: float):
        self.clipper = QKClip(tau, config.num_layers, config.num_heads, config.num_kv_heads)
        self.clipped = 0

    def on_model(self, model: nn.Module) -> None:
        self.clipper.attach(model)

    def before_step(self, module) -> None:
        self.clipper.reset()
        pipeline = getattr(module.runner, "pipeline", None)
        if pipeline is not None:  # its shape inference runs the stages on placeholder activations
            self.clipper.ignore = lambda: pipeline.inferring_shapes

    def after_update(self, module, vetoed: bool) -> None:
        maxima = self.clipper.reduce(module.device)  # every rank, vetoed or not (a collective)
        self.clipped = 0 if vetoed else int((maxima > self.clipper.tau).sum())
        if not vetoed:  # a vetoed step leaves the model as it was
            self.clipper.clip()

    def log_step(self, module) -> None:
        for layer, maxima in enumerate(self.clipper.step_max.cpu()):
            module.log(f"qk_max_logit/blocks.{layer}", float(maxima.max()))
        module.log("qk_clipped_heads", float(self.clipped))  # the same on every rank
