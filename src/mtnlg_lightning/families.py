"""What a model family's spec (`family_specs.py`: its options, its modules' tensor-parallel styles and Hugging Face
names) implies for one config, derived, never restated:
- the shapes and parameter counts are measured on a one-block model built on the meta device (`measure`; tests
  check the measurement against a closed form and against Hugging Face's published counts);
- what one tensor-parallel rank holds follows from the measured shapes and the plan's styles
  (`parameters_per_rank`), and so do the planner's per-stage counts and the FLOPs per token (`matmul_parameters`);
- `parallel/tensor_parallel.py` shards the modules the plan names, as the plan says (`tensor_parallel_plan`: the
  named family's plan, `plan_of`);
- the Hugging Face tensor lists are the measured tensors under the family's names (`hf_tensors`).
A mixture-of-experts block (`moe.py`) is more rows: the router, the experts' stacked `[E, ...]` weights (each one
Hugging Face tensor per expert, `{j}` in its name), the shared expert. A model may mix dense and MoE blocks, so the
measurement holds one block of each kind the model has, and every count sums its layers by kind.

The family is the one `ModelConfig.family` names (`family_of`): nothing here guesses it from the options.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from dataclasses import dataclass

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.family_specs import (
    BLOCK,
    COLUMN,
    EXPERTS,
    FAMILIES,
    HEADS,
    KV_COLUMN,
    LATENT,
    MATMUL_STYLES,
    ROUTER,
    ROUTING_MODULES,  # noqa: F401 - train/optimizer_recipe.py reads it here, with the measured counts
    ROW,
    SHARED_KEY,
    TENSOR_PARALLEL_PLAN,
    VOCAB,
    Family,
    family_spec,
)
from mtnlg_lightning.model import build_model


def family_of(config: ModelConfig, purpose: str = "this") -> Family:
    """The spec of the family `config` names (`ModelConfig.family`); a custom block (no family) is one line saying
    that `purpose` (Hugging Face export, Hugging Face names...) needs one."""
    if config.family is None:
        raise MTNLGError(
            f"{purpose} needs a model family, and this model names none (a custom block): set model.family to one "
            f"of {', '.join(FAMILIES)} (`--model.model_overrides.family NAME`)"
        )
    return family_spec(config.family)


def plan_of(config: ModelConfig) -> dict[str, str]:
    """{module path: tensor-parallel style} of `config`: its family's plan, or every family's for a custom block."""
    return TENSOR_PARALLEL_PLAN if config.family is None else _FAMILY_PLANS[family_spec(config.family).name]


_FAMILY_PLANS = {name: family.tensor_parallel_plan() for name, family in FAMILIES.items()}


# ------------------------------------------------------------------------------------------------ measured
@dataclass(frozen=True)
class Measured:
    """Parameter shapes by module path, {module: {parameter name: shape}}, of a model built on the meta device:
    `block` for one block of each kind the model has (paths under it; a model mixing dense and MoE blocks lists the
    modules of both), `top` for the rest (the LM head even when tied), `kinds` the module paths of each kind's
    block ("dense", "moe")."""

    block: dict[str, dict[str, tuple[int, ...]]]
    top: dict[str, dict[str, tuple[int, ...]]]
    kinds: dict[str, tuple[str, ...]]


def layer_kind(config: ModelConfig, index: int) -> str:
    """dense or moe (the MLP), prefixed linear- in a Gated DeltaNet layer (its token mixer's other parameters)."""
    mlp = "moe" if config.is_moe_layer(index) else "dense"
    return f"linear-{mlp}" if config.layer_types and config.layer_types[index] == "linear_attention" else mlp


_DERIVED: dict[tuple, object] = {}
_VALUE_KEYS: dict[int, tuple[weakref.ref, str]] = {}


def _value_key(config: ModelConfig) -> str:
    """`repr(config)`, made once per config object (a `ModelConfig` is not changed once built)."""
    known = _VALUE_KEYS.get(id(config))
    if known is None or known[0]() is not config:
        forget = functools.partial(_VALUE_KEYS.pop, id(config), None)
        known = _VALUE_KEYS[id(config)] = (weakref.ref(config, lambda _: forget()), repr(config))
    return known[1]


def _per_shape(derive):
    """`derive(config, ...)` computed once per config value: the planner's search asks thousands of times for the
    same few shapes. The results are shared: read them, never change them."""

    @functools.wraps(derive)
    def derived(config: ModelConfig, *args, **kwargs):
        key = (derive.__name__, _value_key(config), args, tuple(kwargs.items()))
        if key not in _DERIVED:
            _DERIVED[key] = derive(config, *args, **kwargs)
        return _DERIVED[key]

    return derived


@_per_shape
def measure(config: ModelConfig, vocab_tensor_parallel: int = 1) -> Measured:
    """The shapes of `config`'s model, its vocabulary padded for `vocab_tensor_parallel` ranks (Megatron's rule),
    measured on a one-block model built on the meta device (nothing is allocated)."""
    multiple = config.make_vocab_size_divisible_by * vocab_tensor_parallel
    # The one-block variants name no family: a mixture of experts' dense variant is no longer of its family.
    # Every attention kind has the same parameters (a sliding layer is a mask), so the one block is a full one.
    one = dataclasses.replace(
        config, num_layers=1, make_vocab_size_divisible_by=multiple, family=None, layer_types=None,
        sliding_rope_theta=None, mtp_layers=0,  # the depths: blocks of these shapes (`mtp_parameters`)
    )  # fmt: skip

    def variant(kind: str) -> ModelConfig:  # the one block of a kind: its MLP, and Gated DeltaNet for linear- ones
        if kind.endswith("dense"):
            block = dataclasses.replace(one, num_experts=0)
        else:
            block = dataclasses.replace(one, first_dense_layers=0, dense_layers=None, moe_layer_step=1)
        return dataclasses.replace(block, layer_types=["linear_attention"]) if kind.startswith("linear-") else block

    present = {layer_kind(config, i) for i in range(config.num_layers)} or {"dense"}
    block, top, kinds = {}, {}, {}
    for kind in sorted(present):
        paths = []
        for path, module in build_model(variant(kind), "meta").named_modules():
            params = {name: tuple(p.shape) for name, p in module.named_parameters(recurse=False)}
            if params and path.startswith("blocks.0."):
                block[path.removeprefix("blocks.0.")] = params
                paths.append(path.removeprefix("blocks.0."))
            elif params:
                top[path] = params
        kinds[kind] = tuple(paths)
    return Measured(block, top, kinds)


def _plan_style(config: ModelConfig, path: str) -> str:
    plan = plan_of(config)
    if path not in plan:
        family = f"family {config.family}" if config.family else "any family"
        raise MTNLGError(f"module {path} has no tensor-parallel style in {family}: add it in family_specs.py")
    return plan[path]


@_per_shape
def tensor_parallel_plan(config: ModelConfig) -> dict[str, str]:
    """{module path in a block: style} of every module of `config`'s block that holds parameters."""
    return {path: _plan_style(config, path) for path in measure(config).block}


def kv_heads_per_rank(config: ModelConfig, tp: int) -> float:
    """Key/value heads one TP rank holds: a share of them, or one replicated head when TP exceeds them."""
    return max(config.num_kv_heads / tp, 1.0)


def _held(config: ModelConfig, style: str, name: str, shape: tuple[int, ...], tp: int) -> int:
    """Elements of one parameter that one of `tp` ranks holds under `style`."""
    numel = math.prod(shape)
    if style == KV_COLUMN:
        rows = int(kv_heads_per_rank(config, tp) * (shape[0] // config.num_kv_heads))
        return numel // shape[0] * rows
    sharded = style in (COLUMN, VOCAB, HEADS) or (style == ROW and name == "weight")
    return numel // tp if sharded else numel


@_per_shape
def parameters_per_rank(config: ModelConfig, tp: int = 1) -> tuple[list[int], dict[str, int]]:
    """(layers, top): parameters one of `tp` tensor-parallel ranks holds in each block, in layer order, and by
    module path outside the blocks (the vocabulary padded for `tp` ranks; the LM head listed even when tied)."""
    shapes = measure(config, tp)
    held = {
        path: sum(_held(config, _plan_style(config, path), name, shape, tp) for name, shape in params.items())
        for path, params in shapes.block.items()
    }
    per_kind = {kind: sum(held[path] for path in paths) for kind, paths in shapes.kinds.items()}
    top = {
        path: sum(_held(config, _plan_style(config, path), name, shape, tp) for name, shape in params.items())
        for path, params in shapes.top.items()
    }
    return [per_kind[layer_kind(config, i)] for i in range(config.num_layers)], top


def _block_numel(config: ModelConfig, shapes: Measured, experts_share: float = 1.0) -> int:
    """Parameters of every block (the experts' weights scaled by `experts_share`: k / E for the active ones)."""
    total = 0.0
    for i in range(config.num_layers):
        for path in shapes.kinds[layer_kind(config, i)]:
            share = experts_share if _plan_style(config, path) == EXPERTS else 1.0
            total += share * _numel(shapes.block[path])
    return round(total)


@_per_shape
def count_parameters(config: ModelConfig, tensor_parallel: int = 1) -> int:
    """Exact parameter count of `GPT(config)` (a tied head counted once), its vocabulary padded for
    `tensor_parallel` ranks; the multi-token prediction depths included (`mtp_parameters`)."""
    shapes = measure(config, tensor_parallel)
    top = {path: _numel(params) for path, params in shapes.top.items()}
    if config.tie_embeddings:
        top.pop("lm_head")
    return _block_numel(config, shapes) + sum(top.values()) + mtp_parameters(config)


@_per_shape
def mtp_parameters(config: ModelConfig, tp: int = 1, ep: int = 1) -> int:
    """Parameters of the multi-token prediction depths (`mtp.py`; 0 without), on one of `tp` tensor-parallel
    ranks with the experts split over `ep`: each depth a block of the last block's kind (sharded as the trunk's),
    eh_proj [H, 2H] and three norms (enorm, hnorm, its own) whole. transformers' main model holds none: the planner
    reports them apart."""
    if not config.mtp_layers:
        return 0
    blocks, top = parameters_per_rank(config, tp)
    experts = expert_parameters_per_layer(config)[-1]
    block = blocks[-1] - experts + experts // ep
    return config.mtp_layers * (block + 2 * config.hidden_size**2 + 3 * top["norm"])


@_per_shape
def expert_parameters_per_layer(config: ModelConfig) -> tuple[int, ...]:
    """Parameters of each block's stacked experts, in layer order (0 for a dense block): whole on every
    tensor-parallel rank, divided by expert parallelism."""
    shapes = measure(config)
    per_kind = {
        kind: sum(_numel(shapes.block[path]) for path in paths if _plan_style(config, path) == EXPERTS)
        for kind, paths in shapes.kinds.items()
    }
    return tuple(per_kind[layer_kind(config, i)] for i in range(config.num_layers))


@_per_shape
def active_parameters(config: ModelConfig) -> int:
    """The parameters one token goes through: `count_parameters` with each MoE block's experts counted at
    experts_per_token / num_experts (the router, any shared expert and everything else whole)."""
    if not config.moe:
        return count_parameters(config)
    shapes = measure(config)
    share = config.experts_per_token / config.num_experts
    top = sum(_numel(params) for path, params in shapes.top.items() if path != "lm_head" or not config.tie_embeddings)
    return _block_numel(config, shapes, share) + top


def _numel(params: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in params.values())


@_per_shape
def matmul_parameters(config: ModelConfig) -> int:
    """Weights that multiply activations per token: every block's Linear layers (the plan's column- and
    row-parallel modules, multi-head latent attention's whole ones), a mixture of experts' router and shared-expert
    gate, the k experts each token goes to (the experts' weights at k / E), and the LM head; each multi-token
    prediction depth's eh_proj, block and head too; the embedding lookup and the norms do no matmul."""
    shapes = measure(config)
    share = config.experts_per_token / config.num_experts if config.num_experts else 1.0
    per_kind = {}
    for kind, paths in shapes.kinds.items():
        styles = {path: _plan_style(config, path) for path in paths}
        per_kind[kind] = sum(
            math.prod(shapes.block[path]["weight"]) * (share if style == EXPERTS else 1.0)
            for path, style in styles.items()
            if style in (*MATMUL_STYLES, ROUTER, EXPERTS) or _whole_linear(style, shapes.block[path])
        )
    blocks = sum(per_kind[layer_kind(config, i)] for i in range(config.num_layers))
    head = math.prod(shapes.top["lm_head"]["weight"])
    # each multi-token prediction depth: eh_proj, a block of the last block's kind and the head again
    depth = per_kind[layer_kind(config, config.num_layers - 1)] + 2 * config.hidden_size**2 + head
    return round(blocks + config.mtp_layers * depth) + head


@_per_shape
def linear_shapes_per_rank(
    config: ModelConfig, tp: int, kind: str | None = None
) -> dict[str, tuple[str, float, float]]:
    """{module path: (style, output features, input features)} of each Linear layer of a block on one of `tp`
    tensor-parallel ranks (the GEMMs the cost model times). Of the block kind most layers have, or `kind`
    (`layer_kind`'s); a token's k experts are one GEMM k times as wide (the same FLOPs), and the router one more."""
    shapes, out = measure(config), {}
    if kind is None:
        kind = "moe" if 2 * len(config.moe_layers) >= config.num_layers and config.moe else "dense"
        kind = kind if kind in shapes.kinds else f"linear-{kind}"  # a model of Gated DeltaNet layers only
    for path in shapes.kinds[kind]:
        style = _plan_style(config, path)
        if style == EXPERTS:
            _, rows, columns = shapes.block[path]["weight"]
            out[path] = (style, rows * config.experts_per_token, columns)
        elif style == ROUTER or _whole_linear(style, shapes.block[path]):
            out[path] = (style, *shapes.block[path]["weight"])
        elif style in MATMUL_STYLES:
            rows, columns = shapes.block[path]["weight"]
            if style == KV_COLUMN:
                out[path] = (style, kv_heads_per_rank(config, tp) * (rows // config.num_kv_heads), columns)
            else:
                out[path] = (style, rows / tp, columns) if style == COLUMN else (style, rows, columns / tp)
    return out


def _whole_linear(style: str, params: dict[str, tuple[int, ...]]) -> bool:
    """A Linear layer every tensor-parallel rank holds whole: multi-head latent attention's latent projections and
    its rotary key (not their norms)."""
    return style in (LATENT, SHARED_KEY) and len(params["weight"]) == 2


# ------------------------------------------------------------------------------------------------ Hugging Face
def hf_tensors(family: Family, config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each model-space tensor of `config` (the tied head left out) and the Hugging Face tensor(s) of `family` it
    is made of, in the family's file order: its module rows, a block's repeated for every layer where the first
    block row stands (the rows of that layer's kind, dense or MoE); an experts' stacked weight is made of one
    tensor per expert, in expert order (`stacked_over_experts`)."""
    shapes = measure(config)
    out: dict[str, tuple[str, ...]] = {}
    rows = list(family.modules.items())
    first = next(n for n, (path, _) in enumerate(rows) if path.startswith(BLOCK))
    blocks = [row for row in rows if row[0].startswith(BLOCK)]
    after = [row for row in rows[first:] if not row[0].startswith(BLOCK)]
    ordered = [(row, None) for row in rows[:first]] + [(row, i) for i in range(config.num_layers) for row in blocks]
    ordered += [(row, None) for row in after]
    for (path, (_, theirs)), i in ordered:
        if i is None:
            params = shapes.top.get(path) if not (path == "lm_head" and config.tie_embeddings) else None
        else:
            inner = path.removeprefix(BLOCK)
            params = shapes.block.get(inner) if inner in shapes.kinds[layer_kind(config, i)] else None
        if not params or theirs is None:
            continue
        sources = (theirs,) if isinstance(theirs, str) else theirs
        if "{j}" in sources[0]:
            sources = tuple(sources[0].replace("{j}", str(j)) for j in range(config.num_experts))
        for kind in params:
            ours = f"{path.format(i=i)}.{kind}"
            out[ours] = tuple(f"{name.format(i=i)}.{kind}" for name in sources)
    return out


def path_in_block(module: str) -> str | None:
    """The path inside its block of a module named `blocks.N.<path>` or `mtp.layers.K.block.<path>` (a
    multi-token prediction depth's block, `mtp.py`); None for a module outside the blocks."""
    if module.startswith("blocks."):
        return module.split(".", 2)[2]
    if module.startswith("mtp.layers.") and module.split(".", 4)[3:4] == ["block"]:
        return module.split(".", 4)[4]
    return None


def stacked_over_experts(name: str) -> bool:
    """Whether a model-space tensor (`blocks.N.<path>.<param>`, or a depth's block's) is experts' weights stacked
    [E, ...]."""
    inner = path_in_block(name.rpartition(".")[0])
    return inner is not None and TENSOR_PARALLEL_PLAN.get(inner) == EXPERTS
