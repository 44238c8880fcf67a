"""MT-NLG's optimizer: AdamW (beta2 = 0.95) with weight decay on weight matrices and embeddings only; or, with
`model.optimizer: muon`, Muon for the hidden weight matrices and that AdamW for the rest (`parallel/muon.py`).

Its own file so the module (which builds it) and the checkpoint reader (which rebuilds its state dict in the same
parameter order) both depend on it, not on each other.
"""

from __future__ import annotations

import torch

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import ROUTING_MODULES
from mtnlg_lightning.moe import moe_layers
from mtnlg_lightning.parallel.muon import MuonAdamW, MuonSettings, Replicas, matrix_layout

OPTIMIZERS = ("adamw", "muon")
# Matrices that stay with AdamW under Muon (Moonlight's recipe, and the routers): the embeddings, the LM head, a
# mixture of experts' router and shared-expert gate; by a component of the parameter's name.
ADAMW_MATRICES = ("embed", "lm_head", *ROUTING_MODULES)


def decay_groups(model: torch.nn.Module) -> list[list]:
    """AdamW's groups, in parameter order: weight matrices and embeddings decay; biases and LayerNorms not; a
    mixture of experts' stacked experts decay in a group of their own (ZeRO reduces and partitions them over the
    ranks holding the same experts under expert parallelism; the groups are the same in every layout, so a
    checkpoint's optimizer fits any). Only parameters that train (a LoRA run's frozen base has no optimizer state),
    and only non-empty groups (LoRA's adapters are all matrices; DeepSpeed drops an empty group, which the LR
    scheduler would still count)."""
    experts = {id(p) for _, layer in moe_layers(model) for p in layer.experts.parameters()}
    decay, no_decay, stacked = [], [], []
    for param in model.parameters():
        if param.requires_grad:
            (stacked if id(param) in experts else decay if param.ndim >= 2 else no_decay).append(param)
    return [group for group in (decay, no_decay, stacked) if group]


def muon_split(model: torch.nn.Module) -> list[list]:
    """Muon's groups, in this order, each present (possibly empty) in every layout and pipeline stage so that a
    checkpoint's groups fit any: AdamW with decay (embeddings, LM head, routers), AdamW without (norms, biases),
    Muon (the blocks' other matrices), Muon of the stacked experts (one matrix per expert). Trained parameters only."""
    experts = {id(p) for _, layer in moe_layers(model) for p in layer.experts.parameters()}
    decay, no_decay, hidden, stacked = [], [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if id(param) in experts:
            stacked.append(param)
        elif param.ndim < 2:
            no_decay.append(param)
        elif set(name.split(".")) & set(ADAMW_MATRICES):
            decay.append(param)
        else:
            hidden.append(param)
    return [decay, no_decay, hidden, stacked]


def optimizer_groups(model: torch.nn.Module, optimizer: str) -> list[list]:
    """The parameter groups of the run's optimizer, in its order (what a checkpoint's optimizer state is read by)."""
    return muon_split(model) if optimizer == "muon" else decay_groups(model)


def build_muon(
    model: torch.nn.Module,
    muon: MuonSettings,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    fused: bool | None,
    fused_qkv_head_dim: int | None = None,
    tp_group=None,
    tp_size: int = 1,
    replicas: Replicas | None = None,
) -> MuonAdamW:
    """Muon for the hidden matrices (its lr and decay default to AdamW's), AdamW (the run's) for the rest.
    `fused_qkv_head_dim`: the model fuses q, k, v in one weight of rows [heads, 3, head_dim]; `tp_group`: the
    tensor-parallel group the shards of this rank's matrices are gathered over; `replicas`: the data-parallel
    replicas the dense Muon matrices are shared out over (`MuonAdamW`)."""
    decay, no_decay, hidden, stacked = muon_split(model)
    settings = {
        "muon": True,
        "lr": lr if muon.lr is None else muon.lr,
        "weight_decay": weight_decay if muon.weight_decay is None else muon.weight_decay,
        "momentum": muon.momentum,
        "nesterov": muon.nesterov,
        "ns_steps": muon.ns_steps,
        "ns_coefficients": tuple(muon.ns_coefficients),
        "eps": muon.eps,
        "adjust_lr": muon.adjust_lr,
        "ns_dtype": muon.ns_dtype,
    }
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": hidden, **settings},
        {"params": stacked, **settings},
    ]
    fused_names = {"qkv"} if fused_qkv_head_dim else set()
    layouts = {}
    for name, param in model.named_parameters():
        qkv = fused_qkv_head_dim if fused_names & set(name.split(".")) else None
        layouts[param] = matrix_layout(param, qkv, tp_size)
    adamw = {"lr": lr, "betas": tuple(betas), "eps": eps, "fused": fused}
    return MuonAdamW(groups, layouts=layouts, tp_group=tp_group, shared=hidden, replicas=replicas, **adamw)


def check_optimizer(optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise MTNLGError(f"model.optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")


def optimizer_settings(hparams) -> MuonSettings | None:
    """Muon's checked settings from the module's hyperparameters (None: AdamW), one line for what does not go
    together."""
    optimizer, muon = hparams.get("optimizer", "adamw"), hparams.get("muon")
    check_optimizer(optimizer)
    settings = MuonSettings.from_dict(muon) if optimizer == "muon" else None
    if muon and settings is None:
        raise MTNLGError("model.muon is set, but model.optimizer is not muon")
    if settings is not None and hparams.get("lora"):
        raise MTNLGError("model.optimizer muon does not train LoRA adapters: use adamw")
    return settings


def build_adamw(
    model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float, fused: bool | None
) -> torch.optim.AdamW:
    """The optimizer every strategy uses (ZeRO receives it as its client optimizer)."""
    groups = [
        {"params": params, "weight_decay": weight_decay if params[0].ndim >= 2 else 0.0}
        for params in decay_groups(model)
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)


class OneMultiplierLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR with one multiplier for every group, applied to each group's own initial lr (`initial_lr`, which
    torch sets at construction) rather than to a list kept per group: DeepSpeed drops a Muon run's empty groups
    (the experts' in a dense model, the embeddings' in a middle pipeline stage) from the optimizer it is given, and
    the schedule goes on over those that remain; a checkpoint's list from another layout is not read either."""

    def __init__(self, optimizer: torch.optim.Optimizer, multiplier):
        super().__init__(optimizer, multiplier)

    def get_lr(self) -> list[float]:
        factor = self.lr_lambdas[0](self.last_epoch)
        return [group["initial_lr"] * factor for group in self.optimizer.param_groups]
