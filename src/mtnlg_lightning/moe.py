"""The mixture-of-experts layer of a block (`ModelConfig.num_experts` > 0): a router, SwiGLU experts stacked as
`[E, ...]` weights, an optional shared expert, and the router's auxiliary losses.

Routing (as transformers' Qwen 3-MoE, Qwen 2-MoE, Mixtral, OLMoE, DeepSeek-V3 and GLM-4.5 route): softmax over the
experts' logits in fp32, the top k, renormalised when `norm_topk_prob` (Mixtral's softmax over the top k is that).
Or (`router: sigmoid`, DeepSeek-V3's): each expert's sigmoid score, the top k chosen by score plus a per-expert bias
that only chooses (the weights are the scores, renormalised when `norm_topk_prob`); after each optimizer step the
bias moves a fixed step toward balance (`balance_expert_bias`), no gradient and no loss involved. DeepSeek-V3's
group limit (`expert_groups`, `expert_groups_per_token`: each token's top k only among the experts of its best
groups, a group scored by its two best choice scores) and its `routed_scaling_factor` apply to either router.
Dispatch: the (token, expert) pairs sorted by expert, each expert's rows one GEMM (`torch._grouped_mm` where it
runs, a loop over the experts otherwise: the same numbers), weighted and summed back per token. Dropless by default;
a `capacity_factor` keeps each expert's first ceil(cf * tokens * k / E) pairs (in token order) and counts the rest.

Each layer keeps the statistics of its last forward (`RouterStats`); `router_losses` combines those of a model's
layers into the auxiliary (Switch/GShard) and z losses.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.torch_compat import grouped_mm, has_grouped_mm

EXPERT_KERNELS = ("auto", "grouped_mm", "loop")


class Gate(nn.Module):
    """A bias-free projection to a few scores per token ([out, H] weight): the router's logits, the shared
    expert's gate. Not an nn.Linear: tensor parallelism replicates it, it never shards it."""

    def __init__(self, hidden_size: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class StackedLinear(nn.Module):
    """One bias-free linear layer per expert, stacked: weight [E, out, in] (expert e's is an nn.Linear's weight)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def forward(self, x: torch.Tensor, counts: list[int], offsets: torch.Tensor | None) -> torch.Tensor:
        """x [N, in], rows sorted by expert (`counts[e]` rows for expert e) -> [N, out]."""
        if offsets is not None:
            return grouped_mm(x, self.weight.transpose(-2, -1), offsets)
        parts = [F.linear(rows, w) for rows, w in zip(x.split(counts), self.weight.unbind(0), strict=True)]
        return torch.cat(parts) if parts else x.new_empty(0, self.weight.shape[1])


class Experts(nn.Module):
    """E SwiGLU experts: down(silu(gate(x)) * up(x)), each expert on its own rows."""

    # auto: torch._grouped_mm where it exists and its alignment holds, else the loop; tests force either.
    kernel = "auto"

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.gate = StackedLinear(num_experts, hidden_size, ffn_hidden_size)
        self.up = StackedLinear(num_experts, hidden_size, ffn_hidden_size)
        self.down = StackedLinear(num_experts, ffn_hidden_size, hidden_size)

    def _grouped(self, x: torch.Tensor) -> bool:
        if self.kernel not in EXPERT_KERNELS:
            raise MTNLGError(f"expert kernel {self.kernel!r} is not one of {', '.join(EXPERT_KERNELS)}")
        if self.kernel == "loop" or x.shape[0] == 0:  # an expert-parallel rank may receive no rows at all
            return False
        # _grouped_mm takes fp32/bf16/fp16 with 16-byte-aligned rows (torch 2.13 on CPU; CUDA not checked here).
        widths = self.gate.weight.shape[1:]
        runs = (
            has_grouped_mm()
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(w * x.element_size() % 16 == 0 for w in widths)
        )
        if self.kernel == "grouped_mm" and not runs:
            raise MTNLGError(f"torch._grouped_mm cannot run {x.dtype} experts of widths {tuple(widths)} here")
        return runs

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, H] sorted by expert, counts [E] -> [N, H]."""
        offsets = counts.cumsum(0).to(torch.int32) if self._grouped(x) else None
        sizes = None if offsets is not None else counts.tolist()
        hidden = F.silu(self.gate(x, sizes, offsets)) * self.up(x, sizes, offsets)
        return self.down(hidden, sizes, offsets)


@dataclass
class RouterStats:
    """One layer's routing of its last forward: what the auxiliary losses and the logs need."""

    probability_sums: torch.Tensor  # [E] fp32, the routing probabilities summed over the tokens (differentiable)
    tokens_per_expert: torch.Tensor  # [E] fp32, top-k assignments per expert (before any capacity drop)
    z_sum: torch.Tensor  # fp32 scalar, sum over the tokens of logsumexp(logits)^2 (differentiable)
    tokens: int
    dropped: int  # (token, expert) pairs over capacity


class MoE(nn.Module):
    """The MLP of a mixture-of-experts block: x [B, S, H] -> [B, S, H]. `shared`: the shared expert (a dense MLP
    every token goes through, scaled by a sigmoid gate where `shared_expert_gated`), or None."""

    def __init__(self, config: ModelConfig, shared: nn.Module | None = None):
        super().__init__()
        h, e = config.hidden_size, config.num_experts
        self.top_k, self.norm_topk_prob = config.experts_per_token, config.norm_topk_prob
        self.groups, self.groups_per_token = config.expert_groups, config.expert_groups_per_token
        self.routed_scaling_factor = config.routed_scaling_factor
        self.capacity_factor = config.capacity_factor
        self.router = Gate(h, e)
        # The sigmoid router's selection bias: state, not a parameter (no gradient reaches it: it only chooses), so a
        # buffer, saved and restored with the weights. fp32 whatever the model is cast to (`_apply`): a bf16 bias
        # of 0.25 would round steps of 1e-3 away.
        self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32) if config.router == "sigmoid" else None)
        self.experts = Experts(e, h, config.moe_ffn_hidden_size)
        # Chosen here, once: the shared expert and its gate, or neither (None).
        self.shared = shared
        self.shared_gate = Gate(h, 1) if shared is not None and config.shared_expert_gated else None
        self.stats: RouterStats | None = None
        # expert parallelism (`parallel/expert_parallel.py`) runs the experts' rows across its ranks; None: here
        self.dispatch = None
        # (group, gradient scale) of each split of the sequence this rank routes a part of: sequence parallelism's
        # TP group (scale 1: its gradients are summed over TP), context parallelism's CP group (scale CP: averaged
        # over DP x CP). The statistics (and so the router's losses) are the whole sequence's, each rank's gradient
        # its own part's.
        self.sequence_groups: list[tuple[object, int]] = []

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, experts [T, k]); records this forward's `stats`."""
        logits = self.router(x)
        if self.expert_bias is None:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            scores, choice = probs, probs
        else:
            scores = torch.sigmoid(logits.float())
            choice = scores.detach() + self.expert_bias
            # the auxiliary loss's routing probabilities (if one is set too): the scores normalised per token, as
            # DeepSeek-V3's complementary sequence-wise loss takes them
            probs = scores / scores.sum(dim=-1, keepdim=True)
        if self.groups > 1:
            choice = within_best_groups(choice.detach(), self.groups, self.groups_per_token)
        chosen = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * self.routed_scaling_factor
        counts = torch.bincount(chosen.flatten(), minlength=probs.shape[-1]).float()
        z = torch.logsumexp(logits.float(), dim=-1).square().sum()
        probability_sums, tokens = probs.sum(dim=0), x.shape[0]
        for group, scale in self.sequence_groups:
            dist.all_reduce(counts, group=group)
            probability_sums, z = _over_slices(probability_sums, group, scale), _over_slices(z, group, scale)
            tokens *= dist.get_world_size(group)
        self.stats = RouterStats(probability_sums, counts, z, tokens, 0)
        return weights.to(x.dtype), chosen

    def _apply(self, fn, recurse=True):
        """Moves and casts as nn.Module does, except that the expert bias keeps its fp32 values through a cast
        (`.to(torch.bfloat16)`, `.half()`): it moves to the new device only."""
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = bias.to(self.expert_bias.device)
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        weights, chosen = self.route(x)
        num_experts = self.router.weight.shape[0]
        flat = chosen.flatten()  # pair p = token p // k, its (p % k)-th choice
        order = torch.argsort(flat, stable=True)  # by expert, then token
        counts = torch.bincount(flat, minlength=num_experts)
        if self.capacity_factor is not None:
            order, counts = self._within_capacity(order, counts, x.shape[0])
        token = order // self.top_k
        # index_select, not x[token]: its backward is an index_add_, where indexing's accumulating index_put_ (each
        # token's k copies summed) is serial on CPU: 1.2x the layer's forward + backward (`bench_moe`, fp32)
        rows = x.index_select(0, token)
        out = self.experts(rows, counts) if self.dispatch is None else self.dispatch(self.experts, rows, counts)
        out = out * weights.flatten()[order, None]
        y = torch.zeros_like(x).index_add_(0, token, out).view(shape)
        if self.shared is not None:  # [B, S, H] as a dense MLP takes it (sequence parallelism gathers along S)
            shared = self.shared(hidden)
            y = y + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(hidden)) * shared)
        return y

    def _within_capacity(self, order: torch.Tensor, counts: torch.Tensor, tokens: int):
        """Each expert's first `capacity` pairs (`order` is sorted by expert, then token); the rest dropped. The
        capacity is counted over the tokens this rank routes, as Megatron's is: a micro-batch's, and under sequence
        parallelism its slice's (so a capacity factor drops per slice; dropless routing is layout-independent)."""
        capacity = math.ceil(self.capacity_factor * tokens * self.top_k / counts.numel())
        starts = counts.cumsum(0) - counts
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
        keep = torch.arange(order.numel(), device=order.device) - starts[expert] < capacity
        self.stats.dropped = int((~keep).sum())
        return order[keep], counts.clamp(max=capacity)


def within_best_groups(choice: torch.Tensor, groups: int, kept: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3): `choice` [T, E] with every expert outside each token's `kept` best of
    `groups` equal groups set to -inf; a group's score is the sum of its two best choice scores."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, groups, experts // groups)
    best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(kept, dim=-1).indices
    allowed = torch.zeros(tokens, groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(tokens, experts)


def _over_slices(local: torch.Tensor, group, scale: int = 1) -> torch.Tensor:
    """The sum over `group`'s sequence slices of a per-slice sum, differentiable in this slice's part only (times
    `scale`): each rank backpropagates its own tokens, and the gradients, summed (scale 1) or averaged (scale: the
    group's size) over the group afterwards, are the whole sum's."""
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    return scale * local + (total - scale * local.detach())


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, layer) of every MoE layer this model (or pipeline stage) holds."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


@contextmanager
def routing_alone(modules):
    """The MoE layers of `modules` route whole sequences for a while: their router statistics are no longer summed
    over the sequence splits (`MoE.sequence_groups`) that sequence or context parallelism set up (decoding runs
    whole sequences on each rank)."""
    layers = [(layer, list(layer.sequence_groups)) for root in modules for _, layer in moe_layers(root)]
    for layer, _ in layers:
        layer.sequence_groups.clear()
    try:
        yield
    finally:
        for layer, groups in layers:
            layer.sequence_groups[:] = groups


def routed_layer_names(config: ModelConfig) -> list[str]:
    """The MoE layers' names, in the order of the router statistics and the balancing: the blocks'
    (`blocks.N.mlp`), then the multi-token prediction depths' where their block routes (`mtp.layers.K.block.mlp`,
    `mtp.py`: a block of the last block's kind), whose routing counts and balances as any layer's (Megatron's)."""
    depths = config.mtp_layers if config.is_moe_layer(config.num_layers - 1) else 0
    return [f"blocks.{i}.mlp" for i in config.moe_layers] + [f"mtp.layers.{k}.block.mlp" for k in range(depths)]


def routed_layer_name(module_name: str) -> str:
    """An MoE layer's name in `routed_layer_names`, without the prefix of what holds the model (a pipeline chunk,
    an engine)."""
    parts = module_name.split(".")
    depth = len(parts) >= 5 and parts[-5:-3] == ["mtp", "layers"]
    return ".".join(parts[-5:] if depth else parts[-3:])


@torch.no_grad()
def balance_expert_bias(model: nn.Module, step_tokens: torch.Tensor, layer_names, rate: float) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3; Megatron's `get_updated_expert_bias`): after an optimizer step,
    each sigmoid router of `model` (or of a pipeline stage) moves its expert bias by `rate` toward the mean load:
    up for an expert that took fewer of the step's (token, expert) assignments than the mean, down for one that
    took more. `step_tokens` [MoE layers (`layer_names` order: `routed_layer_names`), E]: the step's assignments
    over every micro-batch and rank, the same on every rank: every replica's bias stays equal, whatever the
    layout."""
    for name, layer in moe_layers(model):
        if layer.expert_bias is None:
            continue
        counts = step_tokens[layer_names.index(routed_layer_name(name))].to(layer.expert_bias.device, torch.float64)
        layer.expert_bias += rate * torch.sign(counts.mean() - counts).float()


class RouterTotals:
    """The router statistics of one forward, summed over a model's MoE layers, in one flat fp32 tensor: what the
    auxiliary and z losses and the logs need, and what travels from one pipeline stage to the next with the
    activations (each stage adds its layers'; the last computes the losses, their gradient flows back through it).

    Layout: [top-k assignments per MoE layer (layers x E) | probability sums (E) | z sum | rows | dropped pairs].
    The probability and z sums are differentiable, the counts constants."""

    def __init__(self, config: ModelConfig):
        self.layer_names = routed_layer_names(config)
        self.num_experts = config.num_experts
        self.size = (len(self.layer_names) + 1) * self.num_experts + 3

    def zeros(self, device) -> torch.Tensor:
        return torch.zeros(self.size, device=device)

    def add(self, totals: torch.Tensor, model: nn.Module) -> torch.Tensor:
        """`totals` plus the last forward of `model`'s MoE layers (a whole model or a pipeline stage's part)."""
        device = totals.device
        counts = [torch.zeros(self.num_experts, device=device) for _ in self.layer_names]
        probability, z = torch.zeros(self.num_experts, device=device), torch.zeros(1, device=device)
        tokens = dropped = 0
        for name, layer in moe_layers(model):
            if layer.stats is None:
                continue
            counts[self.layer_names.index(routed_layer_name(name))] = layer.stats.tokens_per_expert
            probability, z = probability + layer.stats.probability_sums, z + layer.stats.z_sum
            tokens, dropped = tokens + layer.stats.tokens, dropped + layer.stats.dropped
        scalars = torch.tensor([float(tokens), float(dropped)], device=device)
        return totals + torch.cat([*counts, probability, z, scalars])

    def of(self, model: nn.Module, device) -> torch.Tensor:
        """The totals of `model`'s last forward (the whole model's)."""
        if not any(layer.stats is not None for _, layer in moe_layers(model)):
            raise MTNLGError("router losses need a forward of a model with mixture-of-experts layers first")
        return self.add(self.zeros(device), model)

    def losses(self, totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(auxiliary, z) over the tokens of every MoE layer together, as transformers' `load_balancing_loss_func`
        counts them: E * sum_e f_e * P_e, where f_e is expert e's share of the top-k assignments and P_e its mean
        routing probability, both over every (layer, token) row; z: the mean over those rows of logsumexp(router
        logits)^2. Unscaled: the caller multiplies by router_aux_loss_coef / z_loss_coef."""
        e, rows = self.num_experts, len(self.layer_names) * self.num_experts
        count = totals[-2]
        share = totals[:rows].view(-1, e).sum(dim=0) / count
        probability = totals[rows : rows + e] / count
        return e * (share * probability).sum(), totals[-3] / count

    def expert_tokens(self, totals: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each MoE layer's [E] top-k assignments."""
        per_layer = totals[: len(self.layer_names) * self.num_experts].detach().view(-1, self.num_experts)
        return dict(zip(self.layer_names, per_layer, strict=True))

    @staticmethod
    def dropped(totals: torch.Tensor) -> torch.Tensor:
        return totals[-1].detach()


def router_losses(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(auxiliary, z) of `model`'s last forward (`RouterTotals.losses`)."""
    totals = RouterTotals(model.config)
    return totals.losses(totals.of(model, next(model.parameters()).device))


class WithRouterLosses:
    """A micro-batch's loss `loss_fn(logits, labels)` plus router_aux_loss_coef x aux + router_z_loss_coef x z of
    the forward that made the logits (`RouterTotals`): transformers' objective for these models when
    `output_router_logits` is set. Each micro-batch's own routing: averaged over micro-batches and data-parallel
    replicas with the language-model loss (and weighted as it is). On a pipeline's last stage the output is
    (logits, totals): the totals every stage added to. The unscaled values of the last call are kept (`last`),
    with the dropped (token, expert) pairs under a capacity factor, and summed over the step for the logs.
    `holder.model` is the model whose layers routed (built after this object; a holder keeps it picklable, as a
    lambda would not be)."""

    def __init__(self, loss_fn, holder, config: ModelConfig):
        self.loss_fn, self.holder = loss_fn, holder
        self.totals = RouterTotals(config)
        self.aux_coef, self.z_coef = config.router_aux_loss_coef, config.router_z_loss_coef
        self.capacity = config.capacity_factor is not None
        self.last: dict[str, torch.Tensor] = {}
        # since `reset_step`: per MoE layer, [E] top-k assignments; the unscaled losses' sums, and the calls
        self.expert_tokens: dict[str, torch.Tensor] = {}
        self.step_sums: dict[str, torch.Tensor] = {}
        self.step_calls = 0

    def reset_step(self) -> None:
        self.expert_tokens, self.step_sums, self.step_calls = {}, {}, 0

    def step_means(self) -> dict[str, torch.Tensor]:
        """The unscaled auxiliary and z losses averaged over this step's micro-batches (on this rank)."""
        return {name: total / max(self.step_calls, 1) for name, total in self.step_sums.items()}

    def __call__(self, output, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(output, tuple):  # a pipeline's last stage
            logits, totals = output
        else:
            logits = output
            totals = self.totals.of(self.holder.model, logits.device)
        aux, z = self.totals.losses(totals)
        self.last = {"router_aux_loss": aux.detach(), "router_z_loss": z.detach()}
        for name, value in self.last.items():
            self.step_sums[name] = self.step_sums.get(name, 0) + value
        self.step_calls += 1
        for name, counted in self.totals.expert_tokens(totals).items():
            self.expert_tokens[name] = self.expert_tokens.get(name, 0) + counted
        if self.capacity:  # (token, expert) pairs over capacity, every layer
            self.last["moe_dropped_tokens"] = self.totals.dropped(totals)
        return self.loss_fn(logits, labels) + self.aux_coef * aux + self.z_coef * z
