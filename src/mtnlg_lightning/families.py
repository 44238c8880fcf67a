"""The model families, each described once: GPT (MT-NLG, GPT-3, exported as GPT-2), Llama 3, Qwen 2 and Qwen 3.

A family is a choice of `ModelConfig` options (`config_fields`) for the one module, `model.GPT`, and a table of that
block's modules by path: how tensor parallelism holds each (its plan, torchtitan-style) and which Hugging Face
module it is. Everything else is derived, never restated:
- the shapes and parameter counts are measured on a one-block model built on the meta device (`measure`; tests
  check the measurement against a closed form and against Hugging Face's published counts);
- what one tensor-parallel rank holds follows from the measured shapes and the plan's styles
  (`parameters_per_rank`), and so do the planner's per-stage counts and the FLOPs per token (`matmul_parameters`);
- `parallel/tensor_parallel.py` shards the modules the plan names, as the plan says (`tensor_parallel_plan`);
- the Hugging Face tensor lists are the measured tensors under the family's names (`hf_tensors`).
A new block variant (an MoE layer) is one more set of rows here and, where it has new weights, one more style.
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
MATMUL_STYLES = (COLUMN, KV_COLUMN, ROW)  # the block's Linear layers: weights that multiply activations per token
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
        return all(getattr(config, key) == value for key, value in self.config_fields.items())

    def tensor_parallel_plan(self) -> dict[str, str]:
        """{module path under a block or at the top: style}, as torchtitan declares a plan."""
        return {path.removeprefix(BLOCK): style for path, (style, _) in self.modules.items()}


def _llama_modules(qk_norms: bool) -> dict[str, tuple[str, str | tuple[str, ...] | None]]:
    """Hugging Face's Llama layout (Qwen 2 and 3 share it; Qwen 3 adds q/k norms). Multi-head attention is one
    fused q/k/v projection here, made of their three."""
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
        "norm": (NORM, "model.norm"),
        "lm_head": (VOCAB, "lm_head"),  # stored only when untied
    }


_GPT_BLOCK = dict(position_embedding="learned", norm="layernorm", mlp="gelu", bias=True)
_LLAMA_BLOCK = dict(position_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False)

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
    "qwen3", "Qwen 3", {**_LLAMA_BLOCK, "qkv_bias": False, "qk_norm": True}, _llama_modules(True), "qwen3",
    "Qwen3ForCausalLM",
)  # fmt: skip
FAMILIES = (GPT, LLAMA, QWEN2, QWEN3)


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
    `block` for one block (paths under it), `top` for the rest (the LM head even when tied)."""

    block: dict[str, dict[str, tuple[int, ...]]]
    top: dict[str, dict[str, tuple[int, ...]]]


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
    model = build_model(dataclasses.replace(config, num_layers=1, make_vocab_size_divisible_by=multiple), "meta")
    block, top = {}, {}
    for path, module in model.named_modules():
        params = {name: tuple(p.shape) for name, p in module.named_parameters(recurse=False)}
        if params and path.startswith("blocks.0."):
            block[path.removeprefix("blocks.0.")] = params
        elif params:
            top[path] = params
    return Measured(block, top)


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
def parameters_per_rank(config: ModelConfig, tp: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """(block, top): parameters one of `tp` tensor-parallel ranks holds, by module path, for one block and for the
    modules outside the blocks (the vocabulary padded for `tp` ranks; the LM head listed even when tied)."""
    shapes = measure(config, tp)
    return tuple(
        {
            path: sum(_held(config, _plan_style(path), name, shape, tp) for name, shape in params.items())
            for path, params in part.items()
        }
        for part in (shapes.block, shapes.top)
    )


@_per_shape
def count_parameters(config: ModelConfig, tensor_parallel: int = 1) -> int:
    """Exact parameter count of `GPT(config)` (a tied head counted once), its vocabulary padded for
    `tensor_parallel` ranks."""
    shapes = measure(config, tensor_parallel)
    top = {path: _numel(params) for path, params in shapes.top.items()}
    if config.tie_embeddings:
        top.pop("lm_head")
    return config.num_layers * sum(_numel(params) for params in shapes.block.values()) + sum(top.values())


def _numel(params: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in params.values())


@_per_shape
def matmul_parameters(config: ModelConfig) -> int:
    """Weights that multiply activations per token: every block's Linear layers (the plan's column- and
    row-parallel modules) and the LM head; the embedding lookup and the norms do no matmul."""
    shapes = measure(config)
    plan = tensor_parallel_plan(config)
    per_block = sum(math.prod(shapes.block[path]["weight"]) for path, style in plan.items() if style in MATMUL_STYLES)
    return config.num_layers * per_block + math.prod(shapes.top["lm_head"]["weight"])


@_per_shape
def linear_shapes_per_rank(config: ModelConfig, tp: int) -> dict[str, tuple[str, float, float]]:
    """{module path: (style, output features, input features)} of each Linear layer of a block on one of `tp`
    tensor-parallel ranks (the GEMMs the cost model times)."""
    shapes, out = measure(config), {}
    for path, style in tensor_parallel_plan(config).items():
        if style in MATMUL_STYLES:
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
    block row stands."""
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
            params = shapes.block.get(path.removeprefix(BLOCK))
        if not params or theirs is None:
            continue
        sources = (theirs,) if isinstance(theirs, str) else theirs
        for kind in params:
            ours = f"{path.format(i=i)}.{kind}"
            out[ours] = tuple(f"{name.format(i=i)}.{kind}" for name in sources)
    return out
