"""Mixture of experts as an extension: the router's auxiliary and z losses join the loss (`moe.WithRouterLosses`),
the step's tokens per expert and the router losses are logged, and the sigmoid router's balancing bias moves after
each applied update by the step's loads over every micro-batch and rank (`moe.balance_expert_bias`)."""

from __future__ import annotations

import torch
from torch import nn

from mtnlg_lightning.moe import WithRouterLosses, balance_expert_bias
from mtnlg_lightning.train.extensions.extension import Extension


class RouterBalancing(Extension):
    def __init__(self, config, frozen_base: bool):
        self.config = config
        # LoRA: the bias is the base's, as its frozen weights are
        self.bias_rate = 0.0 if frozen_base else config.expert_bias_update_rate
        self.model: nn.Module | None = None  # the layers that route (`WithRouterLosses` reads their statistics)
        self.losses: WithRouterLosses | None = None
        self.expert_tokens: torch.Tensor | None = None  # the step's, after the update

    def wrap_loss(self, loss_fn):
        self.losses = WithRouterLosses(loss_fn, self, self.config)
        return self.losses

    def on_model(self, model: nn.Module) -> None:
        self.model = model

    def before_step(self, module) -> None:
        self.losses.reset_step()

    def after_update(self, module, vetoed: bool) -> None:
        self.expert_tokens = self._step_expert_tokens(module)
        if self.bias_rate > 0 and not vetoed:  # a vetoed step leaves the model as it was
            balance_expert_bias(module.model, self.expert_tokens, self.losses.totals.layer_names, self.bias_rate)

    def log_step(self, module) -> None:
        for name, value in self._router_logs(module).items():
            module.log(name, value, sync_dist=name.startswith("router_"))
        self._log_expert_tokens(module, self.expert_tokens)

    def _step_expert_tokens(self, module) -> torch.Tensor:
        """[MoE layers, E]: each MoE layer's (token, expert) assignments of the step, summed over micro-batches and
        ranks (one all-reduce, on every rank: a pipeline's last stage holds the counts, the others zeros). fp64:
        a large step's counts pass 2**24, past which fp32 sums depend on their order (so on the layout)."""
        expert_tokens = self.losses.expert_tokens
        none = torch.zeros(self.config.num_experts, device=module.device)
        per_layer = [expert_tokens.get(name, none) for name in self.losses.totals.layer_names]
        local = torch.stack([torch.as_tensor(t, device=module.device) for t in per_layer]).double()
        counts = module.trainer.strategy.reduce(local, reduce_op="sum")
        layout = getattr(module.trainer.strategy, "layout", None)
        # the ranks of a TP (and CP) group count the same tokens: each the whole sequence's
        return counts / (layout.tensor_parallel * layout.context_parallel if layout is not None else 1)

    def _log_expert_tokens(self, module, counts: torch.Tensor) -> None:
        """The step's assignments (`_step_expert_tokens`): `moe_tokens/LAYER/expert_E`, and `moe_max_load/LAYER`,
        the busiest expert's count over the mean (1.0 when balanced)."""
        names = self.losses.totals.layer_names
        for name, per_expert in zip(names, counts.cpu(), strict=True):
            for expert, tokens in enumerate(per_expert.tolist()):
                module.log(f"moe_tokens/{name}/expert_{expert}", tokens)
            module.log(f"moe_max_load/{name}", float(per_expert.max() / per_expert.mean().clamp(min=1e-9)))

    def _router_logs(self, module) -> dict[str, torch.Tensor]:
        """The router's unscaled losses averaged over the step's micro-batches (the caller averages them over the
        ranks, as train_loss: the same values in any layout), and under a capacity factor the (token, expert) pairs
        this rank's last micro-batch dropped. A pipeline's last stage computes them; every rank of the pipeline
        gets its values (rank 0 writes the logs)."""
        losses = self.losses
        values = losses.step_means()
        if losses.capacity and "moe_dropped_tokens" in losses.last:
            values["moe_dropped_tokens"] = losses.last["moe_dropped_tokens"]
        pipeline = getattr(module.runner, "pipeline", None)
        if pipeline is None:
            return values
        names = ["router_aux_loss", "router_z_loss"] + (["moe_dropped_tokens"] if losses.capacity else [])
        local = torch.zeros(len(names), device=module.device)
        if pipeline.is_last:
            local = torch.stack([values[name].float().to(module.device) for name in names])
        return dict(zip(names, pipeline.from_last_stage(local), strict=True))
