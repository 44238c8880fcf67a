"""GPT-OSS's mixture of experts (`ModelConfig.expert_mlp: clamped_swiglu`): the `moe.MoE` layer with a biased router
and biased experts whose SwiGLU is clamped, as transformers' `GptOssMLP` computes it:
- router: `logits = x W^T + b`, the top k of them, a softmax over those k (`moe.MoE`'s softmax over every expert
  then the top k renormalised, `norm_topk_prob`, is the same softmax);
- expert e: `gate = x G_e^T + g_e`, `up = x U_e^T + u_e`; `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`;
  `out = ((up + 1) * gate * sigmoid(alpha * gate)) D_e^T + d_e` (alpha 1.702, limit 7.0 in the published models).
The weights are stacked [E, out, in] like every expert here; Hugging Face's [E, in, 2 x out] with gate and up
interleaved is the mapping's to convert (`interop/gpt_oss_mapping.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.moe import Experts, Gate, MoE


class BiasedGate(Gate):
    """The router with a bias per expert (replicated, as the router is)."""

    def __init__(self, hidden_size: int, out_features: int):
        super().__init__(hidden_size, out_features)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ClampedSwiGLUExperts(Experts):
    """E experts, each with biases [E, out] beside its stacked weights, computing the clamped SwiGLU."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, alpha: float, limit: float):
        super().__init__(num_experts, hidden_size, ffn_hidden_size)
        self.alpha, self.limit = alpha, limit
        for linear, width in ((self.gate, ffn_hidden_size), (self.up, ffn_hidden_size), (self.down, hidden_size)):
            linear.bias = nn.Parameter(torch.zeros(num_experts, width))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, H] sorted by expert, counts [E] (this rank's experts) -> [N, H]."""
        offsets = counts.cumsum(0).to(torch.int32) if self._grouped(x) else None
        sizes = None if offsets is not None else counts.tolist()
        rows = int(x.shape[0])

        def biased(linear, h: torch.Tensor) -> torch.Tensor:  # each row gets its own expert's bias
            return linear(h, sizes, offsets) + linear.bias.repeat_interleave(counts, dim=0, output_size=rows)

        gate = biased(self.gate, x).clamp(max=self.limit)
        up = biased(self.up, x).clamp(min=-self.limit, max=self.limit)
        return biased(self.down, (up + 1) * gate * torch.sigmoid(self.alpha * gate))


class BiasedMoE(MoE):
    """`moe.MoE` with GPT-OSS's router and experts (chosen once, when the block is built)."""

    def __init__(self, config: ModelConfig, shared: nn.Module | None = None):
        super().__init__(config, shared)
        h, e = config.hidden_size, config.num_experts
        self.router = BiasedGate(h, e)
        self.experts = ClampedSwiGLUExperts(e, h, config.moe_ffn_hidden_size, config.swiglu_alpha, config.swiglu_limit)


# By `ModelConfig.expert_mlp`: the layer a mixture-of-experts block is built with.
MOE_LAYERS = {"swiglu": MoE, "clamped_swiglu": BiasedMoE}
