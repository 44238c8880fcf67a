"""The model families, each described once: GPT (MT-NLG, GPT-3, exported as GPT-2), Llama 3, Qwen 2 and Qwen 3, and
the mixtures of experts Qwen 3-MoE, Qwen 2-MoE, Mixtral and OLMoE.

A family is a choice of `ModelConfig` options (`config_fields`) for the one module, `model.GPT`, and a table of that
block's modules by path: how tensor parallelism holds each (its plan, torchtitan-style) and which Hugging Face
module it is. Everything else is derived, never restated:
- the shapes and parameter counts are measured on a one-block model built on the meta device (`measure`; tests
  check the measurement against a closed form and against Hugging Face's published counts);
- what one tensor-parallel rank holds follows from the measured shapes and the plan's styles
  (`parameters_per_rank`), and so do the planner's per-stage counts and the FLOPs per token (`matmul_parameters`);
- `parallel/tensor_parallel.py` shards the modules the plan names, as the plan says (`tensor_parallel_plan`);
- the Hugging Face tensor lists are the measured tensors under the family's names (`hf_tensors`).
A mixture-of-experts block (`moe.py`) is more rows: the router, the experts' stacked `[E, ...]` weights (each one
Hugging Face tensor per expert, `{j}` in its name), the shared expert. A model may mix dense and MoE blocks, so the
measurement holds one block of each kind the model has, and every count sums its layers by kind.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from dataclasses import dataclass

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.model import build_model

# How the tensor-parallel ranks hold a module (Megatron's split; `parallel/tensor_parallel.py` applies them).
COLUMN = "column"  # weight rows (output features) split; its bias split with them
KV_COLUMN = (
    "kv_column"  # column by whole key/value heads, each replicated over TP / kv_heads ranks when TP exceeds them
)
ROW = "row"  # weight columns (input features) split, partial outputs summed; its bias replicated
VOCAB = "vocab"  # vocabulary rows split (the word embedding, the LM head)
HEAD_NORM = "head_norm"  # replicated, applied to this rank's heads only: its gradient summed over TP
NORM = "norm"  # replicated over the hidden size; on the sequence shard under sequence parallelism
REPLICATED = "replicated"  # every rank holds all of it (learned positions)
ROUTER = "router"  # a mixture of experts' router or shared-expert gate: a few scores per token, replicated
EXPERTS = "experts"  # experts stacked [E, out, in]: whole on every tensor-parallel rank (expert parallelism splits E)
MATMUL_STYLES = (COLUMN, KV_COLUMN, ROW)  # the block's Linear layers: weights that multiply activations per token
# Our names of the routing matrices (ROUTER above): the leaves of `mlp.router` and `mlp.shared_gate`, which Muon
# leaves to AdamW (`train/optimizer_recipe.py`).
ROUTING_MODULES = ("router", "shared_gate")
BLOCK = "blocks.{i}."  # the prefix of a block's module paths (`model.GPT.blocks` is keyed by layer index)


@dataclass(frozen=True)
class Family:
    """One model family: its options and its modules. `modules` maps each module path (a block's under `BLOCK`) to
    (tensor-parallel style, Hugging Face module path or paths, or None where the file stores nothing), in the
    order the Hugging Face files list them; a module the config's block does not have (the fused `attn.qkv` of a
    grouped-query model) is skipped."""

    name: str
    label: str  # the Hugging Face family's name, as an export reports it
    config_fields: dict  # the `ModelConfig` values (and derived properties) every model of the family has
    modules: dict[str, tuple[str, str | tuple[str, ...] | None]]
    hf_model_type: str  # config.json's `model_type`
    hf_architecture: str

    def holds(self, config: ModelConfig) -> bool:
        """Whether `config` has every option of the family (a value, or a test of the value where it is callable)."""
        return all(
            value(getattr(config, key)) if callable(value) else getattr(config, key) == value
            for key, value in self.config_fields.items()
        )

    def tensor_parallel_plan(self) -> dict[str, str]:
        """{module path under a block or at the top: style}, as torchtitan declares a plan."""
        return {path.removeprefix(BLOCK): style for path, (style, _) in self.modules.items()}


def _experts(moe: str, router: str, gate: str, up: str, down: str, shared: bool) -> dict:
    """A mixture of experts' rows: its router, the experts (Hugging Face's one module per expert `{j}`) and maybe a
    shared expert with its sigmoid gate (Qwen 2-MoE's names)."""
    experts = f"{moe}experts.{{j}}."
    rows = {
        f"{BLOCK}mlp.router": (ROUTER, f"{moe}{router}"),
        f"{BLOCK}mlp.experts.gate": (EXPERTS, f"{experts}{gate}"),
        f"{BLOCK}mlp.experts.up": (EXPERTS, f"{experts}{up}"),
        f"{BLOCK}mlp.experts.down": (EXPERTS, f"{experts}{down}"),
    }
    if shared:
        rows |= {
            f"{BLOCK}mlp.shared.gate": (COLUMN, f"{moe}shared_expert.gate_proj"),
            f"{BLOCK}mlp.shared.up": (COLUMN, f"{moe}shared_expert.up_proj"),
            f"{BLOCK}mlp.shared.down": (ROW, f"{moe}shared_expert.down_proj"),
            f"{BLOCK}mlp.shared_gate": (ROUTER, f"{moe}shared_expert_gate"),
        }
    return rows


_QWEN_EXPERTS = dict(moe="model.layers.{i}.mlp.", router="gate", gate="gate_proj", up="up_proj", down="down_proj")
# Mixtral's expert MLP: w1 the gate, w3 the up projection, w2 the down projection.
_MIXTRAL_EXPERTS = dict(moe="model.layers.{i}.block_sparse_moe.", router="gate", gate="w1", up="w3", down="w2")


def _llama_modules(qk_norms: bool, experts: dict | None = None) -> dict[str, tuple[str, str | tuple[str, ...] | None]]:
    """Hugging Face's Llama layout (Qwen 2 and 3 share it; Qwen 3 adds q/k norms; the MoE families replace the MLP
    of their MoE blocks by `experts`' rows). Multi-head attention is one fused q/k/v projection here, made of their
    three."""
    layer, attn = "model.layers.{i}.", "model.layers.{i}.self_attn."
    norms = {f"{BLOCK}attn.q_norm": (HEAD_NORM, f"{attn}q_norm"), f"{BLOCK}attn.k_norm": (HEAD_NORM, f"{attn}k_norm")}
    return {
        "embed.wte": (VOCAB, "model.embed_tokens"),
        f"{BLOCK}ln1": (NORM, f"{layer}input_layernorm"),
        f"{BLOCK}attn.qkv": (COLUMN, (f"{attn}q_proj", f"{attn}k_proj", f"{attn}v_proj")),
        f"{BLOCK}attn.q": (COLUMN, f"{attn}q_proj"),
        f"{BLOCK}attn.k": (KV_COLUMN, f"{attn}k_proj"),
        f"{BLOCK}attn.v": (KV_COLUMN, f"{attn}v_proj"),
        f"{BLOCK}attn.proj": (ROW, f"{attn}o_proj"),
        **(norms if qk_norms else {}),
        f"{BLOCK}ln2": (NORM, f"{layer}post_attention_layernorm"),
        f"{BLOCK}mlp.gate": (COLUMN, f"{layer}mlp.gate_proj"),
        f"{BLOCK}mlp.up": (COLUMN, f"{layer}mlp.up_proj"),
        f"{BLOCK}mlp.down": (ROW, f"{layer}mlp.down_proj"),
        **(_experts(**experts) if experts else {}),
        "norm": (NORM, "model.norm"),
        "lm_head": (VOCAB, "lm_head"),  # stored only when untied
    }


_GPT_BLOCK = dict(position_embedding="learned", norm="layernorm", mlp="gelu", bias=True, moe=False)
_LLAMA_BLOCK = dict(position_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False, moe=False)
_MOE_BLOCK = {**_LLAMA_BLOCK, "moe": True, "router": "softmax"}  # none of these families routes by sigmoid

# MT-NLG / GPT-3 and GPT-2: learned positions, LayerNorm, tanh-GELU MLP, multi-head attention, biases, tied head.
GPT = Family(
    name="gpt",
    label="GPT-2",
    config_fields={**_GPT_BLOCK, "qkv_bias": True, "qk_norm": False, "tie_embeddings": True, "fused_qkv": True},
    modules={
        "embed.wte": (VOCAB, "transformer.wte"),
        "embed.wpe": (REPLICATED, "transformer.wpe"),
        "norm": (NORM, "transformer.ln_f"),
        f"{BLOCK}ln1": (NORM, "transformer.h.{i}.ln_1"),
        f"{BLOCK}attn.qkv": (COLUMN, "transformer.h.{i}.attn.c_attn"),
        f"{BLOCK}attn.proj": (ROW, "transformer.h.{i}.attn.c_proj"),
        f"{BLOCK}ln2": (NORM, "transformer.h.{i}.ln_2"),
        f"{BLOCK}mlp.fc1": (COLUMN, "transformer.h.{i}.mlp.c_fc"),
        f"{BLOCK}mlp.fc2": (ROW, "transformer.h.{i}.mlp.c_proj"),
        "lm_head": (VOCAB, None),  # tied to the word embedding on both sides
    },
    hf_model_type="gpt2",
    hf_architecture="GPT2LMHeadModel",
)
# Llama 3: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases; the head tied or not.
LLAMA = Family(
    "llama", "Llama", {**_LLAMA_BLOCK, "qkv_bias": False, "qk_norm": False}, _llama_modules(False), "llama",
    "LlamaForCausalLM",
)  # fmt: skip
# Qwen 2: the Llama block with biases on q, k and v.
QWEN2 = Family(
    "qwen2", "Qwen 2", {**_LLAMA_BLOCK, "qkv_bias": True, "qk_norm": False}, _llama_modules(False), "qwen2",
    "Qwen2ForCausalLM",
)  # fmt: skip
# Qwen 3: the Llama block with an RMSNorm over each head's q and k.
QWEN3 = Family(
    "qwen3", "Qwen 3", {**_LLAMA_BLOCK, "qkv_bias": False, "qk_norm": True, "qk_norm_over": "head"},
    _llama_modules(True), "qwen3", "Qwen3ForCausalLM",
)  # fmt: skip
_NO_SHARED = {"shared_expert_ffn_hidden_size": 0}
# Qwen 3-MoE: the Qwen 3 block with experts (some blocks may stay dense: mlp_only_layers, decoder_sparse_step).
QWEN3_MOE = Family(
    "qwen3_moe", "Qwen 3-MoE", {**_MOE_BLOCK, "qkv_bias": False, "qk_norm": True, "qk_norm_over": "head", **_NO_SHARED},
    _llama_modules(True, {**_QWEN_EXPERTS, "shared": False}), "qwen3_moe", "Qwen3MoeForCausalLM",
)  # fmt: skip
# Qwen 2-MoE: the Qwen 2 block with experts and a shared expert.
QWEN2_MOE = Family(
    "qwen2_moe", "Qwen 2-MoE",
    {**_MOE_BLOCK, "qkv_bias": True, "qk_norm": False, "shared_expert_ffn_hidden_size": lambda width: width > 0},
    _llama_modules(False, {**_QWEN_EXPERTS, "shared": True}), "qwen2_moe", "Qwen2MoeForCausalLM",
)  # fmt: skip
# Mixtral: the Llama block, every block's MLP experts, the top k renormalised.
MIXTRAL = Family(
    "mixtral", "Mixtral",
    {**_MOE_BLOCK, "qkv_bias": False, "qk_norm": False, "every_layer_moe": True, "norm_topk_prob": True, **_NO_SHARED},
    _llama_modules(False, {**_MIXTRAL_EXPERTS, "shared": False}), "mixtral", "MixtralForCausalLM",
)  # fmt: skip
# OLMoE: q/k norms over the whole projections, every block's MLP experts.
OLMOE = Family(
    "olmoe", "OLMoE",
    {**_MOE_BLOCK, "qkv_bias": False, "qk_norm": True, "qk_norm_over": "projection", "every_layer_moe": True,
     **_NO_SHARED},
    _llama_modules(True, {**_QWEN_EXPERTS, "shared": False}), "olmoe", "OlmoeForCausalLM",
)  # fmt: skip
FAMILIES = (GPT, LLAMA, QWEN2, QWEN3, QWEN3_MOE, QWEN2_MOE, MIXTRAL, OLMOE)
MOE_FAMILIES = (QWEN3_MOE, QWEN2_MOE, MIXTRAL, OLMOE)


def _one_plan() -> dict[str, str]:
    """Every module path any family has, and its style: a path means the same module in every family, so a block
    mixing their options (a GPT block with grouped-query attention) is sharded too."""
    plan: dict[str, str] = {}
    for family in FAMILIES:
        for path, style in family.tensor_parallel_plan().items():
            if plan.setdefault(path, style) != style:
                raise MTNLGError(f"families disagree on how tensor parallelism holds {path}: {plan[path]}, {style}")
    return plan


TENSOR_PARALLEL_PLAN = _one_plan()


def family_of(config: ModelConfig) -> Family | None:
    """The family whose options `config` has, or None (a mix of options no published model has)."""
    return next((family for family in FAMILIES if family.holds(config)), None)


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
    return "moe" if config.is_moe_layer(index) else "dense"


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
    one = dataclasses.replace(config, num_layers=1, make_vocab_size_divisible_by=multiple)
    variants = {
        "dense": dataclasses.replace(one, num_experts=0),
        "moe": dataclasses.replace(one, first_dense_layers=0, dense_layers=None, moe_layer_step=1),
    }
    present = {layer_kind(config, i) for i in range(config.num_layers)} or {"dense"}
    block, top, kinds = {}, {}, {}
    for kind in sorted(present):
        paths = []
        for path, module in build_model(variants[kind], "meta").named_modules():
            params = {name: tuple(p.shape) for name, p in module.named_parameters(recurse=False)}
            if params and path.startswith("blocks.0."):
                block[path.removeprefix("blocks.0.")] = params
                paths.append(path.removeprefix("blocks.0."))
            elif params:
                top[path] = params
        kinds[kind] = tuple(paths)
    return Measured(block, top, kinds)


def _plan_style(path: str) -> str:
    if path not in TENSOR_PARALLEL_PLAN:
        raise MTNLGError(f"module {path} has no tensor-parallel style: add it to its family in families.py")
    return TENSOR_PARALLEL_PLAN[path]


@_per_shape
def tensor_parallel_plan(config: ModelConfig) -> dict[str, str]:
    """{module path in a block: style} of every module of `config`'s block that holds parameters."""
    return {path: _plan_style(path) for path in measure(config).block}


def kv_heads_per_rank(config: ModelConfig, tp: int) -> float:
    """Key/value heads one TP rank holds: a share of them, or one replicated head when TP exceeds them."""
    return max(config.num_kv_heads / tp, 1.0)


def _held(config: ModelConfig, style: str, name: str, shape: tuple[int, ...], tp: int) -> int:
    """Elements of one parameter that one of `tp` ranks holds under `style`."""
    numel = math.prod(shape)
    if style == KV_COLUMN:
        rows = int(kv_heads_per_rank(config, tp) * (shape[0] // config.num_kv_heads))
        return numel // shape[0] * rows
    sharded = style in (COLUMN, VOCAB) or (style == ROW and name == "weight")
    return numel // tp if sharded else numel


@_per_shape
def parameters_per_rank(config: ModelConfig, tp: int = 1) -> tuple[list[int], dict[str, int]]:
    """(layers, top): parameters one of `tp` tensor-parallel ranks holds in each block, in layer order, and by
    module path outside the blocks (the vocabulary padded for `tp` ranks; the LM head listed even when tied)."""
    shapes = measure(config, tp)
    held = {
        path: sum(_held(config, _plan_style(path), name, shape, tp) for name, shape in params.items())
        for path, params in shapes.block.items()
    }
    per_kind = {kind: sum(held[path] for path in paths) for kind, paths in shapes.kinds.items()}
    top = {
        path: sum(_held(config, _plan_style(path), name, shape, tp) for name, shape in params.items())
        for path, params in shapes.top.items()
    }
    return [per_kind[layer_kind(config, i)] for i in range(config.num_layers)], top


def _block_numel(config: ModelConfig, shapes: Measured, experts_share: float = 1.0) -> int:
    """Parameters of every block (the experts' weights scaled by `experts_share`: k / E for the active ones)."""
    total = 0.0
    for i in range(config.num_layers):
        for path in shapes.kinds[layer_kind(config, i)]:
            share = experts_share if _plan_style(path) == EXPERTS else 1.0
            total += share * _numel(shapes.block[path])
    return round(total)


@_per_shape
def count_parameters(config: ModelConfig, tensor_parallel: int = 1) -> int:
    """Exact parameter count of `GPT(config)` (a tied head counted once), its vocabulary padded for
    `tensor_parallel` ranks."""
    shapes = measure(config, tensor_parallel)
    top = {path: _numel(params) for path, params in shapes.top.items()}
    if config.tie_embeddings:
        top.pop("lm_head")
    return _block_numel(config, shapes) + sum(top.values())


@_per_shape
def expert_parameters_per_layer(config: ModelConfig) -> tuple[int, ...]:
    """Parameters of each block's stacked experts, in layer order (0 for a dense block): whole on every
    tensor-parallel rank, divided by expert parallelism."""
    shapes = measure(config)
    per_kind = {
        kind: sum(_numel(shapes.block[path]) for path in paths if _plan_style(path) == EXPERTS)
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
    row-parallel modules), a mixture of experts' router and shared-expert gate, the k experts each token goes to
    (the experts' weights at k / E), and the LM head; the embedding lookup and the norms do no matmul."""
    shapes = measure(config)
    share = config.experts_per_token / config.num_experts if config.num_experts else 1.0
    per_kind = {}
    for kind, paths in shapes.kinds.items():
        styles = {path: _plan_style(path) for path in paths}
        per_kind[kind] = sum(
            math.prod(shapes.block[path]["weight"]) * (share if style == EXPERTS else 1.0)
            for path, style in styles.items()
            if style in (*MATMUL_STYLES, ROUTER, EXPERTS)
        )
    blocks = sum(per_kind[layer_kind(config, i)] for i in range(config.num_layers))
    return round(blocks) + math.prod(shapes.top["lm_head"]["weight"])


@_per_shape
def linear_shapes_per_rank(config: ModelConfig, tp: int) -> dict[str, tuple[str, float, float]]:
    """{module path: (style, output features, input features)} of each Linear layer of a block on one of `tp`
    tensor-parallel ranks (the GEMMs the cost model times). Of the block kind most layers have; a token's k
    experts are one GEMM k times as wide (the same FLOPs), and the router one more."""
    shapes, out = measure(config), {}
    kind = "moe" if 2 * len(config.moe_layers) >= config.num_layers and config.moe else "dense"
    for path in shapes.kinds[kind]:
        style = _plan_style(path)
        if style == EXPERTS:
            _, rows, columns = shapes.block[path]["weight"]
            out[path] = (style, rows * config.experts_per_token, columns)
        elif style == ROUTER:
            out[path] = (style, *shapes.block[path]["weight"])
        elif style in MATMUL_STYLES:
            rows, columns = shapes.block[path]["weight"]
            if style == KV_COLUMN:
                out[path] = (style, kv_heads_per_rank(config, tp) * (rows // config.num_kv_heads), columns)
            else:
                out[path] = (style, rows / tp, columns) if style == COLUMN else (style, rows, columns / tp)
    return out


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


def stacked_over_experts(name: str) -> bool:
    """Whether a model-space tensor (`blocks.N.<path>.<param>`) is experts' weights stacked [E, ...]."""
    module = name.rpartition(".")[0]
    if not module.startswith("blocks."):
        return False
    return TENSOR_PARALLEL_PLAN.get(module.split(".", 2)[2]) == EXPERTS
