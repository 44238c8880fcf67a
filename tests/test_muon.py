"""Muon (`--model.optimizer muon`, `parallel/muon.py`): torch.optim.Muon's step for the hidden matrices, each
logical matrix whole (Q, K and V of a fused QKV weight, each expert), AdamW for the rest, in every layout."""

from __future__ import annotations

import re

import pytest
import torch

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.model import build_model
from mtnlg_lightning.parallel.muon import MuonSettings
from mtnlg_lightning.train.optimizer_recipe import build_muon, muon_split

LR, DECAY, BETAS, EPS = 2e-3, 0.1, (0.9, 0.95), 1e-8
MOE = dict(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=32, shared_expert_ffn_hidden_size=48)


def _models():
    """A fused-QKV GPT (Q, K, V in one weight) and a Qwen 2-style MoE (stacked experts, a router, a shared expert
    and its gate), fp32."""
    return {"gpt": get_config("tiny"), "moe": get_config("tiny-llama", **MOE)}


def _loss(model, config, step: int) -> torch.Tensor:
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


class ReferenceSplit:
    """torch.optim.Muon and torch.optim.AdamW on the parameter split of `muon_split`, the fused QKV weights and the
    stacked experts cut into one leaf matrix each (their values and gradients copied in, the results copied back):
    what the unfused model would step."""

    def __init__(self, model, config, settings: dict):
        decay, no_decay, hidden, stacked = muon_split(model)
        names = {id(p): n for n, p in model.named_parameters()}
        self.pieces = []  # (parameter, a function giving the view of one matrix, its leaf [rows, cols])
        for param in hidden + stacked:
            if param.dim() == 3:
                views = [lambda t, e=e: t[e] for e in range(param.shape[0])]
            elif names[id(param)].endswith("qkv.weight"):  # rows [heads, 3, head_dim]
                hd, cols = config.head_dim, param.shape[1]
                views = [lambda t, i=i, hd=hd, cols=cols: t.view(-1, 3, hd, cols)[:, i] for i in range(3)]
            else:
                views = [lambda t: t]
            for view in views:
                leaf = view(param.detach()).reshape(-1, param.shape[-1]).clone()
                self.pieces.append((param, view, torch.nn.Parameter(leaf)))
        self.muon = torch.optim.Muon([leaf for *_, leaf in self.pieces], **settings)
        self.adamw = torch.optim.AdamW(
            [{"params": decay, "weight_decay": DECAY}, {"params": no_decay, "weight_decay": 0.0}],
            lr=LR,
            betas=BETAS,
            eps=EPS,
        )

    @torch.no_grad()
    def step(self) -> None:
        for param, view, leaf in self.pieces:
            leaf.copy_(view(param.detach()).reshape(leaf.shape))
            leaf.grad = view(param.grad).reshape(leaf.shape).clone()
        self.muon.step()
        self.adamw.step()
        for param, view, leaf in self.pieces:
            view(param.data).copy_(leaf.view_as(view(param.data)))


@pytest.mark.parametrize("family", ["gpt", "moe"])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_five_steps_equal_torch_muon_and_adamw_on_the_same_split(family, adjust_lr):
    """One process, fp32, 5 steps: every parameter within 1e-6 of torch.optim.Muon (hidden matrices, Q, K and V of
    the fused QKV weight and each expert separately) plus torch.optim.AdamW (embeddings, head, norms, biases,
    router, shared-expert gate)."""
    config = _models()[family]
    torch.manual_seed(0)
    ours = build_model(config)
    theirs = build_model(config)
    theirs.load_state_dict(ours.state_dict())
    muon = {"lr": 0.02, "weight_decay": 0.05, "momentum": 0.9, "adjust_lr": adjust_lr}
    optimizer = build_muon(ours, MuonSettings.from_dict(muon), LR, DECAY, BETAS, EPS, None, config.head_dim)
    torch_settings = dict(lr=0.02, weight_decay=0.05, momentum=0.9, adjust_lr_fn=adjust_lr)
    reference = ReferenceSplit(theirs, config, torch_settings)
    for step in range(5):
        for model, opt in ((ours, optimizer), (theirs, reference)):
            _loss(model, config, step).backward()
            opt.step()
            model.zero_grad(set_to_none=True)
    expected = dict(theirs.named_parameters())
    apart = {name: (p - expected[name]).abs().max().item() for name, p in ours.named_parameters()}
    assert max(apart.values()) <= 1e-6, sorted(apart.items(), key=lambda kv: -kv[1])[:3]
    moved = {
        name: (p - q).abs().max().item() for (name, p), q in zip(ours.named_parameters(), _initial(config), strict=True)
    }
    assert min(moved.values()) > 0  # every parameter trained


def _initial(config):
    torch.manual_seed(0)
    return [p.detach() for p in build_model(config).parameters()]


def test_the_split_sends_hidden_matrices_and_experts_to_muon_and_the_rest_to_adamw():
    """Moonlight's recipe plus the routers: Muon for attention and MLP projections (dense and shared expert) and
    the stacked experts; AdamW with decay for the embeddings, the LM head, the router and the shared-expert gate;
    AdamW without decay for norms and biases."""
    model = build_model(_models()["moe"])
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay, hidden, stacked = ([names[id(p)] for p in group] for group in muon_split(model))
    block = "blocks.0."
    assert [n for n in decay if not n.startswith("blocks.1.")] == [
        "embed.wte.weight",
        "blocks.0.mlp.router.weight",
        "blocks.0.mlp.shared_gate.weight",
        "lm_head.weight",
    ]
    assert [n for n in no_decay if n.startswith(block)] == ["blocks.0.ln1.weight", "blocks.0.ln2.weight"]
    assert [n.removeprefix(block) for n in hidden if n.startswith(block)] == [
        f"{m}.weight" for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.shared.gate", "mlp.shared.up")
    ] + ["mlp.shared.down.weight"]
    assert [n.removeprefix(block) for n in stacked if n.startswith(block)] == [
        f"mlp.experts.{m}.weight" for m in ("gate", "up", "down")
    ]


@pytest.mark.parametrize(
    ("muon", "message"),
    [
        ({"adjust_lr": "spectral"}, "model.muon.adjust_lr 'spectral' is not one of original, match_rms_adamw"),
        ({"ns_coefficients": [1, 2]}, "model.muon.ns_coefficients takes 3 numbers, got 2"),
        ({"ns_steps": 0}, "model.muon.ns_steps must be in [1, 100), got 0"),
        ({"momentum": 1.0}, "model.muon.momentum must be in [0, 1), got 1.0"),
        ({"lr": -1.0}, "model.muon.lr must be >= 0, got -1.0"),
        ({"beta": 0.9}, "model.muon has no setting 'beta'"),
    ],
)
def test_bad_muon_settings_are_one_line(muon, message):
    with pytest.raises(MTNLGError, match="^" + re.escape(message)):
        MuonSettings.from_dict(muon)


def test_the_module_refuses_another_optimizer_muon_settings_without_muon_and_muon_with_lora():
    from mtnlg_lightning.train.module import MTNLGModule

    with pytest.raises(MTNLGError, match="^model.optimizer 'sgd' is not one of adamw, muon$"):
        MTNLGModule(optimizer="sgd")
    with pytest.raises(MTNLGError, match="^model.muon is set, but model.optimizer is not muon$"):
        MTNLGModule(muon={"lr": 0.02})
    with pytest.raises(MTNLGError, match="^model.optimizer muon does not train LoRA adapters"):
        MTNLGModule(optimizer="muon", lora={"rank": 4})
