"""LoRA (Hu et al. 2021): a frozen projection W plus a trained low-rank update, y = W x + s * B A dropout(x), with
A (r, in), B (out, r), s = alpha / r (rsLoRA: alpha / sqrt(r)). B starts at zero, so the model starts as its base.

A model converter, the first transform `parallelize_gpt` applies: every parameter of the model is frozen (no
gradient, no optimizer state) and each target projection of every block is wrapped in a `LoRALinear`, on the full
single-process model, so every layout starts from the same adapter. Tensor parallelism then shards the wrapped
bases (`shard_with_adapters` hands them to it unwrapped, and shards each adapter like the layer its base became,
as torchtitan does):
- a column-parallel base (output rows split): A whole on every rank, B split like the base's rows. The rank-r
  activation A x is what crosses the TP group: f (identity forward, all-reduce backward) before B, or the
  sequence all-gather under sequence parallelism; A's gradient is then whole (without SP) or a sequence slice's
  share, summed over TP (with SP, as a LayerNorm's);
- a row-parallel base (input columns split): A split like the base's columns, B whole. Each rank's partial
  B A x_local joins the base's partial x_local W_local^T in the layer's one all-reduce (or reduce-scatter), so
  the sum is reduced once and the bias added once, after it; B's gradient, each rank's share, is summed over TP.
Megatron-Bridge instead splits A of a column-parallel base on the rank dimension and all-gathers it: the same
numbers, with a collective of the A x activations either way; the scheme here keeps A and B as the Hugging Face
checkpoint holds them on the ranks that need them whole.

Model-space names: the adapter of `blocks.N.attn.q` is `blocks.N.attn.q.lora_a` (r, in) and `.lora_b` (out, r);
its base weight is `blocks.N.attn.q.weight` (in memory `...attn.q.base.weight`, frozen and never checkpointed).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtnlg_lightning.config import ModelConfig, reject_unknown_fields
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import layer_kind, measure
from mtnlg_lightning.family_specs import BLOCK, COLUMN, MATMUL_STYLES, TENSOR_PARALLEL_PLAN, family_spec
from mtnlg_lightning.parallel.sequence_parallel import (
    all_gather_linear,
    mark_sequence_parallel,
    reduce_scatter_to_sequence_parallel_region,
    sum_gradient_over,
)
from mtnlg_lightning.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    _mark_sharded,
    _shard,
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)


def _projections() -> dict[str, str]:
    """Our projections by short name -> module path inside a block (`q` -> `attn.q`): the block's attention and MLP
    Linear layers in the tensor-parallel plan (`family_specs.py`; a path is one module in every family)."""
    return {
        path.rpartition(".")[2]: path
        for path, style in TENSOR_PARALLEL_PLAN.items()
        if style in MATMUL_STYLES and path.count(".") == 1
    }


PROJECTIONS = _projections()


@functools.cache
def _hf_projection_names(family: str) -> dict[str, tuple[str, ...]]:
    """Hugging Face's names of `family`'s projections -> ours (`q_proj` -> (`q`,); GPT-2's `c_proj` is both its
    attention and its MLP output). A fused q/k/v that Hugging Face keeps apart has no single name there."""
    theirs: dict[str, set[str]] = {}
    for path, (_, hf) in family_spec(family).modules.items():
        inner = path.removeprefix(BLOCK)
        if path.startswith(BLOCK) and inner in PROJECTIONS.values() and isinstance(hf, str):
            theirs.setdefault(hf.rpartition(".")[2], set()).add(inner.rpartition(".")[2])
    return {name: tuple(sorted(shorts)) for name, shorts in theirs.items()}


def hf_projection_names(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Hugging Face's names of the projections of the family `config` names -> ours; none for a custom block."""
    return {} if config.family is None else _hf_projection_names(config.family)


SEPARATE_QKV = ("q", "k", "v")


def _layer_paths(config: ModelConfig, index: int) -> frozenset[str]:
    """The module paths a block of layer `index` holds (a Gated DeltaNet layer's token mixer is not attention's)."""
    return frozenset(measure(config).kinds[layer_kind(config, index)])


def projections_of(config: ModelConfig) -> tuple[str, ...]:
    """The projections the blocks of `config` have, in block order; each layer adapts those it holds
    (`layer_projections`). Multi-head latent attention's are those split by heads (Hugging Face's q_proj or
    q_b_proj, and kv_b_proj): its latent projections, whole on every tensor-parallel rank, take no adapter. A
    Gated DeltaNet layer's (linear_attention) are in_proj_qkvz, in_proj_ba and out_proj; its short convolution
    takes no adapter: a depthwise kernel [channels, 1, kernel] has no low-rank form (peft adapts a grouped
    convolution only with a rank divisible by its groups, here every channel, and cannot merge it), so it stays
    frozen with the base."""
    attention = ("qkv",) if config.fused_qkv else SEPARATE_QKV
    if config.latent_attention:  # the column-parallel ones of its block, as measured
        attention = tuple(
            path.rpartition(".")[2]
            for path in measure(config).block
            if path.startswith("attn.") and TENSOR_PARALLEL_PLAN.get(path) == COLUMN
        )
    mlp = ("gate", "up", "down") if config.mlp in ("swiglu", "geglu") else ("fc1", "fc2")  # geglu: Gemma's
    if config.every_layer_moe:  # every MLP is experts (GPT-OSS, Mixtral, OLMoE): the attention's projections only
        mlp = ()
    held = frozenset().union(*(_layer_paths(config, i) for i in range(config.num_layers)))
    mixers = tuple(  # a token mixer other than attention (Gated DeltaNet): its own projections
        name
        for name, path in PROJECTIONS.items()
        if path.startswith("attn.") and path in held and name not in (*attention, "proj", "qkv", *SEPARATE_QKV)
    )
    return tuple(name for name in (*attention, "proj", *mixers, *mlp) if PROJECTIONS[name] in held)


def layer_projections(config: ModelConfig, names: tuple[str, ...], index: int) -> tuple[str, ...]:
    """Of `names`, those layer `index` of `config` holds (Gated DeltaNet's or the attention's; an MoE layer has
    no MLP projection)."""
    paths = _layer_paths(config, index)
    return tuple(name for name in names if PROJECTIONS[name] in paths)


@dataclass(frozen=True)
class LoRAConfig:
    """`--model.lora '{rank: 16, alpha: 32, dropout: 0.0, targets: [q_proj, v_proj], rslora: false}'`."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None  # ours or Hugging Face's names; None: every attention and MLP projection
    rslora: bool = False  # scale alpha / sqrt(rank) (Kalajdzievski 2023) instead of alpha / rank

    @classmethod
    def from_dict(cls, values: dict) -> LoRAConfig:
        if not isinstance(values, dict):
            raise MTNLGError(f"model.lora takes a mapping such as {{rank: 16, alpha: 32}}, got {values!r}")
        reject_unknown_fields(values, cls, "model.lora has unknown field(s)")
        rank, alpha = values.get("rank", cls.rank), values.get("alpha", cls.alpha)
        dropout, targets = values.get("dropout", cls.dropout), values.get("targets")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise MTNLGError(f"model.lora rank must be an integer > 0, got {rank!r}")
        if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
            raise MTNLGError(f"model.lora alpha must be a number > 0, got {alpha!r}")
        if not isinstance(dropout, int | float) or isinstance(dropout, bool) or not 0 <= dropout < 1:
            raise MTNLGError(f"model.lora dropout must be in [0, 1), got {dropout!r}")
        if isinstance(targets, str):
            targets = [targets]
        if targets is not None and (not targets or not all(isinstance(t, str) for t in targets)):
            raise MTNLGError(f"model.lora targets must be a non-empty list of projection names, got {targets!r}")
        rslora = values.get("rslora", cls.rslora)
        if not isinstance(rslora, bool):
            raise MTNLGError(f"model.lora rslora must be true or false, got {rslora!r}")
        return cls(rank, float(alpha), float(dropout), tuple(targets) if targets else None, rslora)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def projections(self, config: ModelConfig) -> tuple[str, ...]:
        """Our projections the targets name in a block of `config`, in block order; a name the model lacks is one
        line. A fused q/k/v projection is one adapter: its parts are targeted together or not at all."""
        present = projections_of(config)
        if self.targets is None:
            return present
        hf_names = hf_projection_names(config)
        wanted: set[str] = set()
        for target in self.targets:
            ours = (target,) if target in PROJECTIONS else hf_names.get(target, ())
            if "qkv" in present:  # q, k and v are one fused projection here
                ours = tuple("qkv" if name in SEPARATE_QKV else name for name in ours)
            elif "qkv" in ours:  # GPT's fused name on a model with separate q, k, v
                ours = SEPARATE_QKV
            found = [name for name in ours if name in present]
            if not found:
                names = "Hugging Face's names work too" if config.family else "a custom block takes only these"
                raise MTNLGError(
                    f"model.lora targets {target!r}, which this model does not have (its projections: "
                    f"{', '.join(present)}; {names})"
                )
            wanted.update(found)
        if "qkv" in present:
            named = {name for t in self.targets for name in hf_names.get(t, (t,))} & set(SEPARATE_QKV)
            if named and named != set(SEPARATE_QKV):
                raise MTNLGError(
                    f"model.lora targets {', '.join(sorted(named))} of this model's one fused q/k/v projection "
                    f"(as many key/value heads as query heads): target q, k and v together (or qkv)"
                )
        return tuple(name for name in present if name in wanted)


def lora_config(values: dict | LoRAConfig | None) -> LoRAConfig | None:
    if values is None or isinstance(values, LoRAConfig):
        return values
    return LoRAConfig.from_dict(values)


class LoRALinear(nn.Module):
    """A frozen projection (`base`: nn.Linear, or a column- / row-parallel shard of one) with its adapter:
    `lora_a` (r, in) and `lora_b` (out, r), or their shards (see the module docstring)."""

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, dropout: float):
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(lora_a)
        self.lora_b = nn.Parameter(lora_b)
        self.scale = scale
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.enabled = True  # False: the layer is its base alone (`adapters_disabled`)

    @classmethod
    def around(cls, linear: nn.Linear, lora: LoRAConfig, generator: torch.Generator) -> LoRALinear:
        """A wrapping `linear`: A as Kaiming-uniform (a = sqrt(5), as nn.Linear and peft: U(+-1/sqrt(in))) drawn
        from `generator`, B zeros."""
        out_features, in_features = linear.weight.shape
        device, dtype = linear.weight.device, linear.weight.dtype
        if device.type == "meta":  # sizing only
            lora_a = torch.empty(lora.rank, in_features, device=device, dtype=dtype)
        else:
            uniform = torch.rand(lora.rank, in_features, generator=generator, dtype=torch.float64)
            lora_a = ((uniform * 2 - 1) / math.sqrt(in_features)).to(device=device, dtype=dtype)
        lora_b = torch.zeros(out_features, lora.rank, device=device, dtype=dtype)
        return cls(linear, lora_a, lora_b, lora.scale, lora.dropout)

    def _update(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if not self.enabled:
            return base(x)
        if isinstance(base, RowParallelLinear):  # the adapter's partial sum joins the base's in one reduction
            reduce = (
                reduce_scatter_to_sequence_parallel_region
                if base.sequence_parallel
                else reduce_from_tensor_parallel_region
            )
            y = reduce(F.linear(x, base.weight) + self._update(x), base.group)
            return y + base.bias if base.bias is not None else y
        if isinstance(base, ColumnParallelLinear):  # the rank-r activation crosses the group, not x
            down = F.linear(self.dropout(x), self.lora_a)
            if base.sequence_parallel:
                up = all_gather_linear(down, self.lora_b, None, base.group)
            else:
                up = F.linear(copy_to_tensor_parallel_region(down, base.group), self.lora_b)
            return base(x) + self.scale * up
        return base(x) + self._update(x)

    def shard_like(self, base: nn.Module, rank: int, size: int, kv_group=None) -> None:
        """Take `base`, the tensor-parallel layer the wrapped one became, and shard the adapter like it."""
        self.base = base
        if isinstance(base, ColumnParallelLinear):
            weight = base.weight
            index, count = weight.partition_index, weight.partition_count
            shard = nn.Parameter(_shard(self.lora_b, 0, index, count))
            self.lora_b = _mark_sharded(shard, 0, index, count, counted=weight.tensor_model_parallel)
            if count < size and kv_group is not None:  # a key/value head shared by several ranks (its base's copies)
                sum_gradient_over(self.lora_b, kv_group)
            if base.sequence_parallel:  # A saw this rank's sequence slice
                mark_sequence_parallel(self.lora_a, base.group)
        elif isinstance(base, RowParallelLinear):
            self.lora_a = _mark_sharded(nn.Parameter(_shard(self.lora_a, 1, rank, size)), 1, rank, size)
            sum_gradient_over(self.lora_b, base.group)  # each rank's B saw its partial A x
        elif not isinstance(base, nn.Linear):
            raise TypeError(f"LoRA has no sharding for a {type(base).__name__} base")


def _adapted(model: nn.Module):
    """(parent module, attribute, LoRALinear) of every adapter in `model`."""
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                yield parent, attr, child


@contextmanager
def adapters_disabled(model: nn.Module):
    """Within: every adapter of `model` is off and the model computes its base (in any layout: each sharded base
    does its own reduction), e.g. the reference model of LoRA preference tuning, with no second copy."""
    adapters = [adapter for _, _, adapter in _adapted(model)]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield model
    finally:
        for adapter in adapters:
            adapter.enabled = True


def apply_lora(model: nn.Module, lora: LoRAConfig) -> int:
    """Freeze `model` (a full, single-process GPT) and wrap the target projections of every block; returns how many.
    A is drawn from a generator seeded by `torch.initial_seed()` (the run's seed, the same on every rank), in
    block order, so every layout starts from the adapter one process draws."""
    names = lora.projections(model.config)
    for param in model.parameters():
        param.requires_grad_(False)
    generator = torch.Generator().manual_seed(torch.initial_seed())
    count = 0
    for index, block in model.blocks.items():
        for name in layer_projections(model.config, names, int(index)):
            parent_path, attr = PROJECTIONS[name].split(".")
            parent = block.get_submodule(parent_path)
            setattr(parent, attr, LoRALinear.around(getattr(parent, attr), lora, generator))
            count += 1
    return count


def shard_with_adapters(model: nn.Module, shard: Callable[[], object], rank: int, size: int, kv_group=None) -> None:
    """Run `shard()` (tensor parallelism of `model`) on the bases of its adapters, then shard each adapter like its
    base became: the TP plan never sees a `LoRALinear`. A frozen parameter's shards stay frozen."""
    adapted = list(_adapted(model))
    for parent, attr, adapter in adapted:
        setattr(parent, attr, adapter.base)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    shard()
    for name, param in model.named_parameters():  # the shards are new parameters: frozen as their wholes were
        if name in frozen:
            param.requires_grad_(False)
    for parent, attr, adapter in adapted:
        adapter.shard_like(getattr(parent, attr), rank, size, kv_group)
        setattr(parent, attr, adapter)


def lora_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """s * B A in fp32 (or fp64 for fp64 tensors): what merging adds to the base weight."""
    dtype = torch.promote_types(lora_a.dtype, torch.float32)
    return scale * (lora_b.to(dtype) @ lora_a.to(dtype))


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every (unsharded) adapter into its base, W' = W + s B A computed in fp32, and put the base back."""
    for parent, attr, adapter in list(_adapted(model)):
        base = adapter.base
        if type(base) is not nn.Linear:
            raise MTNLGError("merge the adapters of a single-process model (gather a tensor-parallel one first)")
        delta = lora_delta(adapter.lora_a, adapter.lora_b, adapter.scale)
        merged = base.weight.to(delta.dtype) + delta
        base.weight.copy_(merged.to(base.weight.dtype))
        setattr(parent, attr, base)
    return model


def stored_parameters(model: nn.Module, settings: dict | None) -> dict[str, nn.Parameter]:
    """The parameters a checkpoint stores of `model` (a full GPT, any device): every one, or with a LoRA run's
    recorded `settings`, its adapters only (put on `model` here; the base is frozen, not stored)."""
    if settings is None:
        return dict(model.named_parameters())
    apply_lora(model, lora_config(settings))
    return {name: param for name, param in model.named_parameters() if param.requires_grad}


def adapter_names(config: ModelConfig, lora: LoRAConfig) -> dict[str, str]:
    """Model-space adapter module of every target (`blocks.N.attn.q`) -> its base weight's name."""
    names = lora.projections(config)
    layers = range(config.num_layers)
    modules = (f"blocks.{i}.{PROJECTIONS[name]}" for i in layers for name in layer_projections(config, names, i))
    return {module: f"{module}.weight" for module in modules}
