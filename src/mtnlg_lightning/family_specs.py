"""The model families, each one registered spec, chosen by name: `ModelConfig.family` (`--model.model_overrides.family
qwen3`, or the preset's, or the Hugging Face directory's `model_type`) names one of `FAMILIES`: GPT (MT-NLG, GPT-3,
exported as GPT-2), Llama 3, Qwen 2 and Qwen 3, and the mixtures of experts Qwen 3-MoE, Qwen 2-MoE, Mixtral, OLMoE,
DeepSeek-V3 (with multi-head latent attention) and GLM-4.5; and the families with other attention kinds per layer
(`attention_kinds.py`): Gemma 3 (sliding windows), GPT-OSS (windows, sinks, biased experts) and Qwen3-Next (Gated
DeltaNet).

A spec (`Family`, as torchtitan's `TrainSpec` per model) holds, once:
- its block options (`block`): the `ModelConfig` values every model of the family has. Naming the family gives them
  (an option left unset takes the family's value); a config that names the family and sets another value is refused
  in one line (`ModelConfig.__post_init__`);
- its mixture-of-experts options, nested (`experts`: the router, a shared expert, whether every block routes), or None
  for a dense family;
- a table of the block's modules by path: how tensor parallelism holds each (its plan, torchtitan-style) and which
  Hugging Face module it is (`modules`), and the Hugging Face family's names (`hf_model_type`, `hf_architecture`).
Everything measured from a family (shapes, counts, the Hugging Face tensor lists) is in `families.py`.

A config that names no family (`family: null`) is a custom block: a mix of options no published model has (a GPT
block with grouped-query attention, say). It trains, is planned and sharded (`TENSOR_PARALLEL_PLAN`, every family's
paths), and has no Hugging Face form. A checkpoint written before configs named their family (no `family` key) gets
its family from its options in one place, `config.config_from_stored`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mtnlg_lightning.errors import MTNLGError

# How the tensor-parallel ranks hold a module (Megatron's split; `parallel/tensor_parallel.py` applies them).
COLUMN = "column"  # weight rows (output features) split; its bias split with them
KV_COLUMN = (
    "kv_column"  # column by whole key/value heads, each replicated over TP / kv_heads ranks when TP exceeds them
)
ROW = "row"  # weight columns (input features) split, partial outputs summed; its bias replicated
VOCAB = "vocab"  # vocabulary rows split (the word embedding, the LM head)
# values per head along dim 0 of every parameter (attention sinks [heads]; Gated DeltaNet's A_log and dt_bias per
# value head and its convolution's channels, held grouped by key head): each rank keeps its heads' rows, as q
HEADS = "heads"
HEAD_NORM = "head_norm"  # replicated, applied to each rank's heads (q/k norms, Gated DeltaNet's gated norm)
NORM = "norm"  # replicated over the hidden size; on the sequence shard under sequence parallelism
REPLICATED = "replicated"  # every rank holds all of it (learned positions)
ROUTER = "router"  # a mixture of experts' router or shared-expert gate: a few scores per token, replicated
EXPERTS = "experts"  # experts stacked [E, out, in]: whole on every tensor-parallel rank (expert parallelism splits E)
# Multi-head latent attention's (`mla.py`): a latent projection or its norm, whole on every rank, on the sequence
# shard under sequence parallelism (its gradient then summed over TP, as a norm's); the column-parallel layer after
# it gathers the latent and sums its gradient
LATENT = "latent"
# the rotary key every head shares (MLA's `k_rope`): whole on every rank, its input gathered like a column layer's,
# its gradient (each rank's from its own heads) summed over TP
SHARED_KEY = "shared_key"
MATMUL_STYLES = (COLUMN, KV_COLUMN, ROW)  # the block's Linear layers: weights that multiply activations per token
# Our names of the routing matrices (ROUTER above): the leaves of `mlp.router` and `mlp.shared_gate`, which Muon
# leaves to AdamW (`train/optimizer_recipe.py`).
ROUTING_MODULES = ("router", "shared_gate")
BLOCK = "blocks.{i}."  # the prefix of a block's module paths (`model.GPT.blocks` is keyed by layer index)


@dataclass(frozen=True)
class Experts:
    """A family's mixture-of-experts options, nested in its spec (torchtitan's `MoEArgs`): the sizes (how many
    experts, k, their width) are each model's own `ModelConfig` values."""

    router: str = "softmax"  # or "sigmoid": DeepSeek-V3's and GLM-4.5's
    shared_expert: bool = False  # Qwen 2-MoE's sigmoid-gated shared expert (shared_expert_ffn_hidden_size > 0)
    every_layer: bool = False  # every block's MLP routes (Mixtral, OLMoE); else some may stay dense (Qwen's)
    norm_topk_prob: bool | None = None  # fixed by the family (Mixtral renormalises the top k); None: the model's
    shared_expert_gated: bool = True  # Qwen 2-MoE gates its shared expert; DeepSeek-V3's are added as they are

    def options(self) -> dict:
        """The `ModelConfig` values this nesting fixes."""
        fixed = {"router": self.router, "norm_topk_prob": self.norm_topk_prob}
        if not self.shared_expert:
            fixed["shared_expert_ffn_hidden_size"] = 0
        else:
            fixed["shared_expert_gated"] = self.shared_expert_gated
        return {key: value for key, value in fixed.items() if value is not None}


@dataclass(frozen=True)
class Family:
    """One model family. `modules` maps each module path (a block's under `BLOCK`) to (tensor-parallel style,
    Hugging Face module path or paths, or None where the file stores nothing), in the order the Hugging Face files
    list them; a module the config's block does not have (the fused `attn.qkv` of a grouped-query model) is
    skipped."""

    name: str  # `ModelConfig.family`
    label: str  # the Hugging Face family's name, as an export reports it
    block: dict  # the `ModelConfig` values every model of the family has
    modules: dict[str, tuple[str, str | tuple[str, ...] | None]]
    hf_model_type: str  # config.json's `model_type`
    hf_architecture: str
    experts: Experts | None = None  # a mixture of experts' options; None: a dense family
    grouped_query: bool = True  # False: multi-head attention only (num_kv_heads = num_heads: GPT-2's one c_attn)
    latent_attention: bool = False  # multi-head latent attention (DeepSeek-V3: kv_lora_rank set), or none
    options: dict = field(init=False)  # `block` and the nested experts' options: what naming the family sets

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", {**self.block, **(self.experts.options() if self.experts else {})})

    def contradiction(self, config) -> str | None:
        """What of `config` (its options set, as `ModelConfig.__post_init__` leaves them) is not this family's,
        as a phrase naming the option, or None."""
        for key, value in self.options.items():
            if getattr(config, key) != value:
                return f"{key}={getattr(config, key)!r} (a {self.name} model has {key}={value!r})"
        if not self.grouped_query and config.num_kv_heads != config.num_heads:
            return f"num_kv_heads={config.num_kv_heads} (a {self.name} model has num_kv_heads = num_heads)"
        if config.latent_attention != self.latent_attention:
            needs = "has" if self.latent_attention else "has no"
            return f"kv_lora_rank={config.kv_lora_rank} (a {self.name} model {needs} multi-head latent attention)"
        if self.experts is None and config.num_experts:
            return f"num_experts={config.num_experts} (a {self.name} model is dense: num_experts=0)"
        if self.experts is not None and not config.num_experts:
            return f"num_experts=0 (a {self.name} model is a mixture of experts: set num_experts and experts_per_token)"
        if self.experts is not None and self.experts.shared_expert and config.shared_expert_ffn_hidden_size <= 0:
            return f"shared_expert_ffn_hidden_size=0 (a {self.name} model has a shared expert: set its width)"
        if self.experts is not None and self.experts.every_layer and not config.every_layer_moe:
            return f"dense blocks (every block of a {self.name} model routes: no first_dense_layers, dense_layers)"
        return None

    def tensor_parallel_plan(self) -> dict[str, str]:
        """{module path under a block or at the top: style}, as torchtitan declares a plan."""
        return {path.removeprefix(BLOCK): style for path, (style, _) in self.modules.items()}


def _experts(moe: str, router: str, gate: str, up: str, down: str, shared: bool | str) -> dict:
    """A mixture of experts' rows: its router, the experts (Hugging Face's one module per expert `{j}`) and maybe a
    shared expert with its sigmoid gate (Qwen 2-MoE's names), or (`shared` "ungated") DeepSeek-V3's shared experts,
    one SwiGLU of n_shared_experts x their width, without a gate."""
    experts = f"{moe}experts.{{j}}."
    rows = {
        f"{BLOCK}mlp.router": (ROUTER, f"{moe}{router}"),
        f"{BLOCK}mlp.experts.gate": (EXPERTS, f"{experts}{gate}"),
        f"{BLOCK}mlp.experts.up": (EXPERTS, f"{experts}{up}"),
        f"{BLOCK}mlp.experts.down": (EXPERTS, f"{experts}{down}"),
    }
    if shared == "ungated":
        rows |= {
            f"{BLOCK}mlp.shared.gate": (COLUMN, f"{moe}shared_experts.gate_proj"),
            f"{BLOCK}mlp.shared.up": (COLUMN, f"{moe}shared_experts.up_proj"),
            f"{BLOCK}mlp.shared.down": (ROW, f"{moe}shared_experts.down_proj"),
        }
    elif shared:
        rows |= {
            f"{BLOCK}mlp.shared.gate": (COLUMN, f"{moe}shared_expert.gate_proj"),
            f"{BLOCK}mlp.shared.up": (COLUMN, f"{moe}shared_expert.up_proj"),
            f"{BLOCK}mlp.shared.down": (ROW, f"{moe}shared_expert.down_proj"),
            f"{BLOCK}mlp.shared_gate": (ROUTER, f"{moe}shared_expert_gate"),
        }
    return rows


_QWEN_EXPERTS = dict(moe="model.layers.{i}.mlp.", router="gate", gate="gate_proj", up="up_proj", down="down_proj")
# DeepSeek-V3's and GLM-4.5's: Qwen's names, and ungated shared experts.
_DEEPSEEK_EXPERTS = dict(_QWEN_EXPERTS, shared="ungated")
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


def _mla_modules() -> dict[str, tuple[str, str | tuple[str, ...] | None]]:
    """DeepSeek-V3's layout: the Llama rows with multi-head latent attention in place of q/k/v (`mla.py`: q or
    q_down, its norm and q_up; kv_down and k_rope, the two parts of Hugging Face's `kv_a_proj_with_mqa`, the latent's
    norm and kv_up) and DeepSeek's experts."""
    attn = "model.layers.{i}.self_attn."
    rows = _llama_modules(False, _DEEPSEEK_EXPERTS)
    latent = {
        f"{BLOCK}attn.q": (COLUMN, f"{attn}q_proj"),
        f"{BLOCK}attn.q_down": (LATENT, f"{attn}q_a_proj"),
        f"{BLOCK}attn.q_down_norm": (LATENT, f"{attn}q_a_layernorm"),
        f"{BLOCK}attn.q_up": (COLUMN, f"{attn}q_b_proj"),
        f"{BLOCK}attn.kv_down": (LATENT, f"{attn}kv_a_proj_with_mqa"),
        f"{BLOCK}attn.k_rope": (SHARED_KEY, f"{attn}kv_a_proj_with_mqa"),
        f"{BLOCK}attn.kv_down_norm": (LATENT, f"{attn}kv_a_layernorm"),
        f"{BLOCK}attn.kv_up": (COLUMN, f"{attn}kv_b_proj"),
    }
    out = {}
    for path, row in rows.items():
        if path == f"{BLOCK}attn.qkv":
            out |= latent
        elif path not in (f"{BLOCK}attn.q", f"{BLOCK}attn.k", f"{BLOCK}attn.v"):
            out[path] = row
    return out


_GPT_BLOCK = dict(position_embedding="learned", norm="layernorm", mlp="gelu", bias=True)
_LLAMA_BLOCK = dict(position_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False)
_NO_QK_NORM = dict(qk_norm=False)
_HEAD_QK_NORM = dict(qk_norm=True, qk_norm_over="head")  # an RMSNorm over each head's q and k (Qwen 3)

# MT-NLG / GPT-3 and GPT-2: learned positions, LayerNorm, tanh-GELU MLP, multi-head attention, biases, tied head.
GPT = Family(
    name="gpt",
    label="GPT-2",
    block={**_GPT_BLOCK, "qkv_bias": True, **_NO_QK_NORM, "tie_embeddings": True},
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
    grouped_query=False,
)
# Llama 3: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases; the head tied or not.
LLAMA = Family(
    "llama", "Llama", {**_LLAMA_BLOCK, "qkv_bias": False, **_NO_QK_NORM}, _llama_modules(False), "llama",
    "LlamaForCausalLM",
)  # fmt: skip
# Qwen 2: the Llama block with biases on q, k and v.
QWEN2 = Family(
    "qwen2", "Qwen 2", {**_LLAMA_BLOCK, "qkv_bias": True, **_NO_QK_NORM}, _llama_modules(False), "qwen2",
    "Qwen2ForCausalLM",
)  # fmt: skip
# Qwen 3: the Llama block with an RMSNorm over each head's q and k.
QWEN3 = Family(
    "qwen3", "Qwen 3", {**_LLAMA_BLOCK, "qkv_bias": False, **_HEAD_QK_NORM}, _llama_modules(True), "qwen3",
    "Qwen3ForCausalLM",
)  # fmt: skip
# Qwen 3-MoE: the Qwen 3 block with experts (some blocks may stay dense: mlp_only_layers, decoder_sparse_step).
QWEN3_MOE = Family(
    "qwen3_moe", "Qwen 3-MoE", {**_LLAMA_BLOCK, "qkv_bias": False, **_HEAD_QK_NORM},
    _llama_modules(True, {**_QWEN_EXPERTS, "shared": False}), "qwen3_moe", "Qwen3MoeForCausalLM", Experts(),
)  # fmt: skip
# Qwen 2-MoE: the Qwen 2 block with experts and a shared expert.
QWEN2_MOE = Family(
    "qwen2_moe", "Qwen 2-MoE", {**_LLAMA_BLOCK, "qkv_bias": True, **_NO_QK_NORM},
    _llama_modules(False, {**_QWEN_EXPERTS, "shared": True}), "qwen2_moe", "Qwen2MoeForCausalLM",
    Experts(shared_expert=True),
)  # fmt: skip
# Mixtral: the Llama block, every block's MLP experts, the top k renormalised.
MIXTRAL = Family(
    "mixtral", "Mixtral", {**_LLAMA_BLOCK, "qkv_bias": False, **_NO_QK_NORM},
    _llama_modules(False, {**_MIXTRAL_EXPERTS, "shared": False}), "mixtral", "MixtralForCausalLM",
    Experts(every_layer=True, norm_topk_prob=True),
)  # fmt: skip
# OLMoE: q/k norms over the whole projections, every block's MLP experts.
OLMOE = Family(
    "olmoe", "OLMoE", {**_LLAMA_BLOCK, "qkv_bias": False, "qk_norm": True, "qk_norm_over": "projection"},
    _llama_modules(True, {**_QWEN_EXPERTS, "shared": False}), "olmoe", "OlmoeForCausalLM", Experts(every_layer=True),
)  # fmt: skip
# DeepSeek-V3 (and R1, Kimi K2): multi-head latent attention, sigmoid routing with a balancing bias in groups, ungated
# shared experts, the first blocks dense.
DEEPSEEK_V3 = Family(
    "deepseek_v3", "DeepSeek-V3", {**_LLAMA_BLOCK, "qkv_bias": False, **_NO_QK_NORM}, _mla_modules(), "deepseek_v3",
    "DeepseekV3ForCausalLM", Experts(router="sigmoid", shared_expert=True, shared_expert_gated=False),
    latent_attention=True,
)  # fmt: skip
# GLM-4.5 / 4.6: grouped-query attention (q/k/v biases and q/k norms optional, partial rotary), DeepSeek-V3's routing.
GLM4_MOE = Family(
    "glm4_moe", "GLM-4.5", {**_LLAMA_BLOCK, "qk_norm_over": "head"}, _llama_modules(True, _DEEPSEEK_EXPERTS),
    "glm4_moe", "Glm4MoeForCausalLM", Experts(router="sigmoid", shared_expert=True, shared_expert_gated=False),
)  # fmt: skip


def _attention_rows() -> dict[str, tuple[str, str | tuple[str, ...] | None]]:
    """The rows a layout of Llama's names begins with: the embedding, the first norm and the attention's
    projections (for the families after Llama's, which `_llama_modules` does not build)."""
    layer, attn = "model.layers.{i}.", "model.layers.{i}.self_attn."
    return {
        "embed.wte": (VOCAB, "model.embed_tokens"),
        f"{BLOCK}ln1": (NORM, f"{layer}input_layernorm"),
        f"{BLOCK}attn.qkv": (COLUMN, (f"{attn}q_proj", f"{attn}k_proj", f"{attn}v_proj")),
        f"{BLOCK}attn.q": (COLUMN, f"{attn}q_proj"),
        f"{BLOCK}attn.k": (KV_COLUMN, f"{attn}k_proj"),
        f"{BLOCK}attn.v": (KV_COLUMN, f"{attn}v_proj"),
        f"{BLOCK}attn.proj": (ROW, f"{attn}o_proj"),
    }


def _gemma3_modules() -> dict[str, tuple[str, str | tuple[str, ...] | None]]:
    """Gemma 3's layout: Llama's names, q/k norms, and four norms per block (Hugging Face's post-attention norm is
    the attention output's, its pre-feed-forward norm our `ln2`)."""
    layer, attn = "model.layers.{i}.", "model.layers.{i}.self_attn."
    return {
        **_attention_rows(),
        f"{BLOCK}attn.q_norm": (HEAD_NORM, f"{attn}q_norm"),
        f"{BLOCK}attn.k_norm": (HEAD_NORM, f"{attn}k_norm"),
        f"{BLOCK}post_attn_norm": (NORM, f"{layer}post_attention_layernorm"),
        f"{BLOCK}ln2": (NORM, f"{layer}pre_feedforward_layernorm"),
        f"{BLOCK}mlp.gate": (COLUMN, f"{layer}mlp.gate_proj"),
        f"{BLOCK}mlp.up": (COLUMN, f"{layer}mlp.up_proj"),
        f"{BLOCK}mlp.down": (ROW, f"{layer}mlp.down_proj"),
        f"{BLOCK}post_mlp_norm": (NORM, f"{layer}post_feedforward_layernorm"),
        "norm": (NORM, "model.norm"),
        "lm_head": (VOCAB, "lm_head"),  # stored only when untied
    }


# Gemma 3 (text): (1 + w) RMSNorms, four per block, q/k norms, the embedding scaled by sqrt(H), a tanh-GELU gated
# MLP, sliding-window layers with their own RoPE base between the global ones (`layer_types`).
GEMMA3 = Family(
    "gemma3_text", "Gemma 3",
    {**_LLAMA_BLOCK, "norm": "rmsnorm_plus_one", "mlp": "geglu", "qkv_bias": False, **_HEAD_QK_NORM,
     "post_block_norms": True, "scale_embeddings": True, "attention_sinks": False},
    _gemma3_modules(), "gemma3_text", "Gemma3ForCausalLM",
)  # fmt: skip


def _gpt_oss_modules() -> dict[str, tuple[str, str | tuple[str, ...] | None]]:
    """GPT-OSS's layout: Llama's attention names with biases and sinks, a biased router, experts stored as
    parameters of one module ([E, in, 2 x out] gate and up interleaved, [E, in, out] down, their biases): their
    Hugging Face names and layout are `interop/gpt_oss_mapping.py`'s (None here)."""
    layer = "model.layers.{i}."
    return {
        **_attention_rows(),
        f"{BLOCK}attn.sinks": (HEADS, None),
        f"{BLOCK}ln2": (NORM, f"{layer}post_attention_layernorm"),
        f"{BLOCK}mlp.router": (ROUTER, f"{layer}mlp.router"),
        f"{BLOCK}mlp.experts.gate": (EXPERTS, None),
        f"{BLOCK}mlp.experts.up": (EXPERTS, None),
        f"{BLOCK}mlp.experts.down": (EXPERTS, None),
        "norm": (NORM, "model.norm"),
        "lm_head": (VOCAB, "lm_head"),  # stored only when untied
    }


# GPT-OSS: sliding-window and full layers alternating, learned attention sinks, biases on q, k, v and o, YaRN RoPE
# (the model's rope_scaling), every block's MLP experts with a biased router and the clamped SwiGLU.
GPT_OSS = Family(
    "gpt_oss", "GPT-OSS",
    {**_LLAMA_BLOCK, "qkv_bias": True, "attention_output_bias": True, "attention_sinks": True, **_NO_QK_NORM,
     "expert_mlp": "clamped_swiglu"},
    _gpt_oss_modules(), "gpt_oss", "GptOssForCausalLM", Experts(every_layer=True, norm_topk_prob=True),
)  # fmt: skip


def _qwen3_next_modules() -> dict[str, tuple[str, str | tuple[str, ...] | None]]:
    """Qwen3-Next's layout: its full layers Qwen 3's attention (q 2x wide: each head's query and output gate), its
    linear layers Gated DeltaNet (`linear_attn`; its decay parameters A_log and dt_bias on that module itself), every
    MLP Qwen 2-MoE's experts with a shared expert, or a dense MLP (mlp_only_layers)."""
    layer, attn, linear = "model.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}.linear_attn."
    return {
        **_attention_rows(),
        f"{BLOCK}attn.q_norm": (HEAD_NORM, f"{attn}q_norm"),
        f"{BLOCK}attn.k_norm": (HEAD_NORM, f"{attn}k_norm"),
        f"{BLOCK}attn.decay": (HEADS, linear.removesuffix(".")),  # A_log and dt_bias: linear_attn's own
        f"{BLOCK}attn.in_proj_qkvz": (COLUMN, f"{linear}in_proj_qkvz"),  # grouped by key head: whole heads a rank
        f"{BLOCK}attn.in_proj_ba": (COLUMN, f"{linear}in_proj_ba"),
        f"{BLOCK}attn.conv1d": (HEADS, f"{linear}conv1d"),
        f"{BLOCK}attn.norm": (HEAD_NORM, f"{linear}norm"),
        f"{BLOCK}attn.out_proj": (ROW, f"{linear}out_proj"),
        f"{BLOCK}ln2": (NORM, f"{layer}post_attention_layernorm"),
        f"{BLOCK}mlp.gate": (COLUMN, f"{layer}mlp.gate_proj"),
        f"{BLOCK}mlp.up": (COLUMN, f"{layer}mlp.up_proj"),
        f"{BLOCK}mlp.down": (ROW, f"{layer}mlp.down_proj"),
        **_experts(**_QWEN_EXPERTS, shared=True),
        "norm": (NORM, "model.norm"),
        "lm_head": (VOCAB, "lm_head"),  # stored only when untied
    }


# Qwen3-Next: three Gated DeltaNet layers to one gated full attention (partial RoPE, (1 + w) q/k norms), (1 + w)
# block norms, experts with a sigmoid-gated shared expert.
QWEN3_NEXT = Family(
    "qwen3_next", "Qwen3-Next",
    {**_LLAMA_BLOCK, "norm": "rmsnorm_plus_one", "qkv_bias": False, **_HEAD_QK_NORM, "attention_output_gate": True},
    _qwen3_next_modules(), "qwen3_next", "Qwen3NextForCausalLM", Experts(shared_expert=True),
)  # fmt: skip
# The registry: `ModelConfig.family` names one of these.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        GPT,
        LLAMA,
        QWEN2,
        QWEN3,
        QWEN3_MOE,
        QWEN2_MOE,
        MIXTRAL,
        OLMOE,
        DEEPSEEK_V3,
        GLM4_MOE,
        GEMMA3,
        GPT_OSS,
        QWEN3_NEXT,
    )
}


def family_spec(name: str) -> Family:
    """The registered family `name` (one line naming the registered ones otherwise)."""
    if name not in FAMILIES:
        raise MTNLGError(
            f"model family {name!r} is not one of {', '.join(FAMILIES)} (or null: a custom block, no Hugging Face form)"
        )
    return FAMILIES[name]


def _one_plan() -> dict[str, str]:
    """Every module path any family has, and its style: a path means the same module in every family, so a custom
    block mixing their options (a GPT block with grouped-query attention) is sharded too."""
    plan: dict[str, str] = {}
    for family in FAMILIES.values():
        for path, style in family.tensor_parallel_plan().items():
            if plan.setdefault(path, style) != style:
                raise MTNLGError(f"families disagree on how tensor parallelism holds {path}: {plan[path]}, {style}")
    return plan


# A custom block's plan (a config naming no family); a named family's is its own (`Family.tensor_parallel_plan`).
TENSOR_PARALLEL_PLAN = _one_plan()
