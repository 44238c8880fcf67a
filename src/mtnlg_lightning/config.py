"""Model hyper-parameters and named presets (tiny ... mtnlg-530b)."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

import yaml

from mtnlg_lightning.attention_kinds import check_attention_kinds
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.family_specs import FAMILIES, family_spec

POSITION_EMBEDDINGS = ("learned", "rope")
# rmsnorm_plus_one: Gemma's RMSNorm, computed in fp32 and scaled by (1 + weight), its weight starting at 0
NORMS = ("layernorm", "rmsnorm", "rmsnorm_plus_one")
# geglu: down(gelu_tanh(gate(x)) * up(x)) (Gemma's gelu_pytorch_tanh MLP)
MLPS = ("gelu", "swiglu", "geglu")
# softmax: over the experts, then the top k (renormalised when norm_topk_prob); sigmoid: each expert's own score,
# the top k chosen by score + a per-expert bias that balances the load without a loss (DeepSeek-V3)
ROUTERS = ("softmax", "sigmoid")
# The experts' MLP: swiglu (bias-free, every MoE family but GPT-OSS) or clamped_swiglu (GPT-OSS: biased router and
# experts, gate and up clamped at swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate); `biased_experts.py`)
EXPERT_MLPS = ("swiglu", "clamped_swiglu")
EXPERT_BIAS_UPDATE_RATE = 1e-3  # the sigmoid router's default bias step (DeepSeek-V3's gamma, Megatron's default)
QK_NORMS = ("head", "projection")  # over each head's dims (Qwen 3) or the whole q / k projection (OLMoE)
ROPE_SCALINGS = ("default", "linear", "llama3", "yarn")  # Hugging Face's `rope_type` names


@dataclass
class ModelConfig:
    """One decoder, its block chosen by its family's name (`family`: gpt, llama, qwen2, qwen3, qwen3_moe, qwen2_moe,
    mixtral, olmoe, deepseek_v3, glm4_moe; `family_specs.py`): naming a family gives its block options (an option
    left unset takes the family's value) and refuses one that contradicts it. With no family (null) the block is
    custom: its options as set, each unset one the MT-NLG / GPT-3 block's (learned positions, LayerNorm, GELU MLP,
    biases, tied head)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int = 50257
    ffn_hidden_size: int | None = None  # None -> 4 * hidden_size
    # Megatron pads the vocabulary so the embedding splits evenly and GEMMs stay aligned.
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int | None = None  # None -> seq_len
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_eps: float = 1e-5  # the epsilon of every norm, LayerNorm or RMSNorm
    init_std: float | None = None  # None -> sqrt(1 / (3 * hidden_size)), as MT-NLG
    name: str = "custom"  # the preset's (or source's) name, for the logs
    # The model family, by name: its block options (the options below marked "family's") come with it, and an
    # export writes its Hugging Face form. null: a custom block, no Hugging Face form (`family_specs.py`).
    family: str | None = None
    # The block options a family fixes, marked family's: unset (None), the named family's value; without a family
    # (custom), the MT-NLG block's, shown after "custom".
    position_embedding: str | None = None  # family's: learned (a position table) | rope (rotary); custom: learned
    rope_theta: float = 10000.0
    # Hugging Face's form: {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # "original_max_position_embeddings": 8192}, or {"rope_type": "linear", "factor": F}; None: unscaled.
    rope_scaling: dict | None = None
    norm: str | None = None  # family's: layernorm | rmsnorm; custom: layernorm
    mlp: str | None = None  # family's: gelu (fc1, fc2) | swiglu (down(silu(gate(x)) * up(x))); custom: gelu
    num_kv_heads: int | None = None  # None -> num_heads (MHA); fewer is grouped-query attention, 1 is MQA
    head_dim: int | None = None  # None -> hidden_size / num_heads
    qk_norm: bool | None = None  # family's: an RMSNorm over q and k before RoPE (Qwen 3); custom: false
    bias: bool | None = None  # family's: biases of the linear layers and LayerNorms; custom: true
    qkv_bias: bool | None = None  # family's: biases of q, k, v only (Qwen 2); custom: as `bias`
    tie_embeddings: bool | None = None  # the LM head is the word embedding (family's for gpt: true); unset: true
    # family's: head (Qwen 3) | projection (OLMoE: one RMSNorm over all heads' q, one over k); custom: head
    qk_norm_over: str | None = None
    # Mixture of experts (`moe.py`): 0 experts is a dense MLP in every block.
    num_experts: int = 0
    experts_per_token: int = 1  # top k
    moe_ffn_hidden_size: int | None = None  # each expert's SwiGLU width; None -> ffn_hidden_size
    # Qwen 2-MoE's shared expert (sigmoid-gated), 0: none (family's: 0 for every family but qwen2_moe); unset: 0
    shared_expert_ffn_hidden_size: int | None = None
    # Which blocks are MoE (the rest keep the dense MLP of ffn_hidden_size): all three rules hold.
    moe_layer_step: int = 1  # every step-th block: layer i when (i + 1) % step == 0 (Qwen's decoder_sparse_step)
    first_dense_layers: int = 0  # the first k blocks stay dense (DeepSeek's first_k_dense_replace)
    dense_layers: list[int] | None = None  # these blocks stay dense (Qwen's mlp_only_layers)
    # family's: softmax over every expert's logit, then the top k; or sigmoid (`ROUTERS`); custom: softmax
    router: str | None = None
    # sigmoid router: after each optimizer step every expert's selection bias moves by this toward balance (+ when
    # it took fewer tokens than the mean, - when more); None: 0.001 (EXPERT_BIAS_UPDATE_RATE); 0: the bias stays 0
    router_bias_update_rate: float | None = None
    # renormalise the k chosen probabilities (Mixtral: a softmax over the top k; family's for mixtral); unset: false
    norm_topk_prob: bool | None = None
    router_aux_loss_coef: float = 0.0  # Switch / GShard load balancing, as transformers computes it
    router_z_loss_coef: float = 0.0  # ST-MoE: mean logsumexp(router logits)^2
    capacity_factor: float | None = None  # None: dropless; else each expert takes ceil(cf * tokens * k / E)
    # Group-limited routing (DeepSeek-V3's n_group): the experts split in this many equal groups, each scored by
    # the sum of its two best choice scores (1: no limit)
    expert_groups: int = 1
    expert_groups_per_token: int = 1  # a token's top k only among the experts of its best groups (topk_group)
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this (DeepSeek-V3: 2.5)
    # the shared expert scaled by a sigmoid gate (Qwen 2-MoE: true) or added as it is (DeepSeek-V3, GLM-4.5: false);
    # family's; custom: true
    shared_expert_gated: bool | None = None
    # Multi-head latent attention (DeepSeek-V2/V3, `mla.py`), on when set: keys and values come up from a latent
    # this wide (and its RMSNorm); head_dim is then each q/k head's width; null: no latent attention
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None  # MLA's queries from a latent this wide (and its RMSNorm); null: one q projection
    qk_rope_head_dim: int | None = None  # MLA: the last dims of each q/k head that rotate (one key shared by all heads)
    v_head_dim: int | None = None  # MLA: each value head's width
    # the rotary dims pair as (0, 1), (2, 3)... and come out de-interleaved (Hugging Face's `rope_interleave`,
    # DeepSeek's checkpoints); false: the first half pairs with the second, as every other family
    rope_interleave: bool = False
    # the share of each head's dims that rotate (the first ones; GLM-4.5: 0.5, Qwen3-Next: 0.25), the rest pass
    # through
    partial_rotary_factor: float = 1.0
    # Attention kinds per layer (`attention_kinds.py`), Hugging Face's `layer_types`: one of full_attention,
    # sliding_attention, linear_attention (Gated DeltaNet, `linear_attention.py`) per layer; None: every layer full
    # causal attention.
    layer_types: list[str] | None = None
    sliding_window: int | None = None  # the keys a sliding layer's query sees, itself included (HF's sliding_window)
    sliding_rope_theta: float | None = None  # the sliding layers' RoPE base (Gemma 3's local base); None: rope_theta
    # family's: a learned logit per head that joins every softmax and takes a share of it (GPT-OSS); custom: false
    attention_sinks: bool | None = None
    attention_output_bias: bool | None = None  # a bias on the attention's output projection; None: as `bias`
    attention_softmax_scale: float | None = None  # None: head_dim^-0.5 (Gemma 3: query_pre_attn_scalar^-0.5)
    # family's: a norm on the attention's and the MLP's outputs before each residual add (Gemma's four norms per
    # block); custom: false
    post_block_norms: bool | None = None
    expert_mlp: str | None = None  # family's: swiglu | clamped_swiglu (GPT-OSS's, EXPERT_MLPS); custom: swiglu
    swiglu_alpha: float = 1.702  # clamped_swiglu: the sigmoid's slope
    swiglu_limit: float = 7.0  # clamped_swiglu: gate <= limit, -limit <= up <= limit
    scale_embeddings: bool | None = None  # family's: the word embedding times sqrt(hidden_size) (Gemma); custom: false
    # family's: the q projection also makes a gate per head, the attention's output times sigmoid(gate) before the
    # output projection (Qwen3-Next); custom: false
    attention_output_gate: bool | None = None
    # Gated DeltaNet (linear_attention layers, `linear_attention.py`), Hugging Face's names:
    linear_num_key_heads: int | None = None  # query / key heads
    linear_num_value_heads: int | None = None  # value heads (a multiple of the key heads; each its own state)
    linear_key_head_dim: int | None = None  # d_k
    linear_value_head_dim: int | None = None  # d_v (a state is d_k x d_v per value head)
    linear_conv_kernel_dim: int | None = None  # the causal depthwise convolution's kernel
    # Multi-token prediction (DeepSeek-V3's sequential modules, `mtp.py`): this many extra depths, depth k predicting
    # the token k + 1 ahead through one more block of the last block's kind and the shared embedding and LM head;
    # trained only (off in generation). 0: none. HF's num_nextn_predict_layers.
    mtp_layers: int = 0
    # the MTP loss joins the loss as weight / mtp_layers x the sum of the depths' losses (Megatron's
    # mtp_loss_scaling_factor; DeepSeek-V3 trained with 0.3, then 0.1)
    mtp_loss_weight: float = 0.1

    def __post_init__(self) -> None:
        apply_family(self)
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_len
        if self.init_std is None:
            self.init_std = math.sqrt(1.0 / (3.0 * self.hidden_size))
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        if self.attention_output_bias is None:
            self.attention_output_bias = self.bias
        for name, value, choices in (
            ("position_embedding", self.position_embedding, POSITION_EMBEDDINGS),
            ("norm", self.norm, NORMS),
            ("mlp", self.mlp, MLPS),
            ("expert_mlp", self.expert_mlp, EXPERT_MLPS),
        ):
            if value not in choices:
                raise MTNLGError(f"model {name} {value!r} is not one of {', '.join(choices)}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise MTNLGError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise MTNLGError(
                f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads} (each key/value "
                f"head serves a whole group of query heads)"
            )
        check_latent_attention(self)
        if self.position_embedding == "rope" and self.rotary_dim % 2:
            raise MTNLGError(f"rope needs an even number of rotary dims, got {self.rotary_dim}")
        check_rope_scaling(self.rope_scaling)
        if self.qk_norm_over not in QK_NORMS:
            raise MTNLGError(f"model qk_norm_over {self.qk_norm_over!r} is not one of {', '.join(QK_NORMS)}")
        check_experts(self)
        check_multi_token_prediction(self)
        check_attention_kinds(self)
        check_family(self)
        if self.seq_len > self.max_position_embeddings:
            raise MTNLGError(
                f"seq_len {self.seq_len} is above the position table size {self.max_position_embeddings} "
                f"(max_position_embeddings); lower seq_len or raise max_position_embeddings"
            )

    @property
    def fused_qkv(self) -> bool:
        """One q/k/v projection, rows laid out [heads, 3, head_dim] (multi-head attention); grouped-query
        attention has three (its key/value heads may be replicated over the tensor-parallel ranks)."""
        return self.num_kv_heads == self.num_heads and not self.attention_output_gate  # a gate rides on q's own

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (`mla.py`): keys and values from a compressed latent."""
        return self.kv_lora_rank is not None

    @property
    def rotary_dim(self) -> int:
        """The dims of each q/k head that rotate: MLA's rotary part, else the first partial_rotary_factor share."""
        if self.latent_attention:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe(self) -> bool:
        """Whether any block has a mixture-of-experts layer."""
        return bool(self.moe_layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the blocks whose MLP is a mixture of experts."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def expert_bias_update_rate(self) -> float:
        """The step of the sigmoid router's balancing bias (0: none; a softmax router has no bias)."""
        if self.router != "sigmoid":
            return 0.0
        rate = self.router_bias_update_rate
        return EXPERT_BIAS_UPDATE_RATE if rate is None else float(rate)

    @property
    def every_layer_moe(self) -> bool:
        return len(self.moe_layers) == self.num_layers

    def is_moe_layer(self, index: int) -> bool:
        return (
            self.num_experts > 0
            and index >= self.first_dense_layers
            and index not in (self.dense_layers or ())
            and (index + 1) % self.moe_layer_step == 0
        )

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return int(math.ceil(self.vocab_size / multiple) * multiple)


# The options a config naming no family takes where unset: the MT-NLG / GPT-3 block (the first presets').
CUSTOM_BLOCK = dict(
    position_embedding="learned", norm="layernorm", mlp="gelu", bias=True, qk_norm=False, qk_norm_over="head",
    tie_embeddings=True, router="softmax", norm_topk_prob=False, shared_expert_ffn_hidden_size=0,
    shared_expert_gated=True,
    attention_sinks=False, post_block_norms=False, scale_embeddings=False, expert_mlp="swiglu",
    attention_output_gate=False,
)  # fmt: skip


def apply_family(config: ModelConfig) -> None:
    """Each block option left unset (None) takes the named family's value, then the custom block's; `qkv_bias`
    without either follows `bias`. A value set that contradicts the family is `check_family`'s to refuse."""
    options = family_spec(config.family).options if config.family is not None else {}
    for key, value in {**CUSTOM_BLOCK, **options}.items():
        if getattr(config, key) is None:
            setattr(config, key, value)


def check_family(config: ModelConfig) -> None:
    """A config naming a family has its options (one line naming the option and the family otherwise)."""
    if config.family is None:
        return
    wrong = family_spec(config.family).contradiction(config)
    if wrong is not None:
        raise MTNLGError(
            f"model option {wrong} contradicts family {config.family}: change the option, name the family it belongs "
            f"to, or set family null for a custom block"
        )


def config_from_stored(values: dict) -> ModelConfig:
    """A `ModelConfig` from its stored fields (a checkpoint's manifest). With `stored_preset_config`, the one place a
    family is derived from options: a config written before configs named their family (no `family` key) is the
    registered family whose options it has, or a custom block when none has them all. New configs carry the name."""
    if "family" in values:
        return ModelConfig(**values)
    config = ModelConfig(**values, family=None)
    matching = [name for name, family in FAMILIES.items() if family.contradiction(config) is None]
    return dataclasses.replace(config, family=matching[0]) if matching else config


def stored_preset_config(preset: str, overrides: dict) -> ModelConfig:
    """The config a Lightning checkpoint's hyper-parameters (`preset`, `model_overrides`) describe; overrides
    written before configs named their family (no `family` key) take it from their options, not from the preset
    (`config_from_stored`)."""
    if "family" in overrides:
        return get_config(preset, **overrides)
    values = preset_values(preset, overrides)
    values.pop("family", None)
    return config_from_stored(values)


def check_multi_token_prediction(config: ModelConfig) -> None:
    layers, weight = config.mtp_layers, config.mtp_loss_weight
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise MTNLGError(f"model.mtp_layers must be an integer >= 0, got {layers!r}")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
        raise MTNLGError(f"model.mtp_loss_weight must be a number >= 0, got {weight!r}")


def check_experts(config: ModelConfig) -> None:
    """A mixture-of-experts setting the block can run (one line otherwise)."""
    if config.num_experts == 0:
        return
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    if config.num_experts < 0 or not 1 <= config.experts_per_token <= config.num_experts:
        raise MTNLGError(
            f"experts_per_token {config.experts_per_token} must be between 1 and num_experts {config.num_experts}"
        )
    if config.mlp != "swiglu":
        raise MTNLGError("mixture-of-experts blocks have SwiGLU experts: set mlp to swiglu")
    if config.router not in ROUTERS:
        raise MTNLGError(f"router {config.router!r} is not one of {', '.join(ROUTERS)}")
    rate = config.router_bias_update_rate
    if rate is not None and config.router != "sigmoid":
        raise MTNLGError("router_bias_update_rate moves the sigmoid router's expert bias: set router to sigmoid")
    if rate is not None and not (isinstance(rate, int | float) and 0 <= rate < math.inf):
        raise MTNLGError(f"router_bias_update_rate must be a number >= 0 (0: no bias), got {rate!r}")
    if config.moe_layer_step < 1 or config.first_dense_layers < 0:
        raise MTNLGError("moe_layer_step must be >= 1 and first_dense_layers >= 0")
    if config.capacity_factor is not None and config.capacity_factor <= 0:
        raise MTNLGError(f"capacity_factor must be positive or null (dropless), got {config.capacity_factor}")
    check_expert_groups(config)


def check_expert_groups(config: ModelConfig) -> None:
    """Group-limited routing the experts can be split for (one line otherwise)."""
    groups, kept, experts = config.expert_groups, config.expert_groups_per_token, config.num_experts
    if groups < 1 or experts % groups:
        raise MTNLGError(f"expert_groups {groups} does not divide num_experts {experts} into equal groups")
    if not 1 <= kept <= groups:
        raise MTNLGError(f"expert_groups_per_token {kept} must be between 1 and expert_groups {groups}")
    if groups > 1 and experts // groups < 2:
        raise MTNLGError(f"expert groups of {experts // groups} expert: a group is scored by its two best experts")
    if config.experts_per_token > kept * (experts // groups):
        raise MTNLGError(
            f"experts_per_token {config.experts_per_token} is more than the {kept * (experts // groups)} experts of "
            f"the expert_groups_per_token {kept} groups a token may use"
        )
    if config.routed_scaling_factor <= 0:
        raise MTNLGError(f"routed_scaling_factor must be positive, got {config.routed_scaling_factor}")


def check_latent_attention(config: ModelConfig) -> None:
    """Multi-head latent attention with the sizes it needs, or partial rotary dims that make sense (one line
    otherwise)."""
    if not 0 < config.partial_rotary_factor <= 1:
        raise MTNLGError(f"partial_rotary_factor must be in (0, 1], got {config.partial_rotary_factor}")
    if not config.latent_attention:
        named = [k for k in ("q_lora_rank", "qk_rope_head_dim", "v_head_dim") if getattr(config, k) is not None]
        if named:
            raise MTNLGError(f"{', '.join(named)} are multi-head latent attention's: set kv_lora_rank too")
        return
    sizes = {k: getattr(config, k) for k in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim")}
    if config.q_lora_rank is not None:
        sizes["q_lora_rank"] = config.q_lora_rank
    bad = [f"{k}={v!r}" for k, v in sizes.items() if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1)]
    if bad:
        raise MTNLGError(f"multi-head latent attention needs positive integer sizes, got {', '.join(bad)}")
    if config.v_head_dim > config.head_dim:
        raise MTNLGError(f"v_head_dim {config.v_head_dim} is above head_dim {config.head_dim} (each q/k head's width)")
    if config.head_dim <= config.qk_rope_head_dim:
        raise MTNLGError(
            f"head_dim {config.head_dim} (each q/k head) must be more than its rotary qk_rope_head_dim "
            f"{config.qk_rope_head_dim}"
        )
    if config.position_embedding != "rope" or config.qk_norm or config.partial_rotary_factor != 1:
        raise MTNLGError("multi-head latent attention rotates its own rope part: rope positions, no qk_norm")
    if config.num_kv_heads != config.num_heads:
        raise MTNLGError("multi-head latent attention has a key and a value per query head: num_kv_heads = num_heads")


def check_rope_scaling(scaling: dict | None) -> None:
    """A rope_scaling of a known type with the fields it needs (one line otherwise)."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise MTNLGError(f"rope_scaling must be a mapping with rope_type, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_SCALINGS:
        raise MTNLGError(f"rope_scaling of unknown type {kind!r}; known types: {', '.join(ROPE_SCALINGS)}")
    needed = {"linear": ("factor",), "llama3": LLAMA3_SCALING_FIELDS, "yarn": YARN_SCALING_FIELDS}.get(kind, ())
    missing = [k for k in needed if not isinstance(scaling.get(k), int | float) or isinstance(scaling.get(k), bool)]
    if missing:
        raise MTNLGError(f"rope_scaling of type {kind} needs the number(s) {', '.join(missing)}")


LLAMA3_SCALING_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_SCALING_FIELDS = ("factor", "original_max_position_embeddings")  # beta_fast, beta_slow, truncate: defaults
# Today's decoder block (Llama 3, Mixtral): RoPE, RMSNorm, SwiGLU, no biases, untied head.
ROPE_BLOCK = dict(position_embedding="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)
LLAMA_31 = dict(
    family="llama",
    **ROPE_BLOCK,
    vocab_size=128256,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
    init_std=0.02,
)


# Qwen 3 (Qwen3-8B's config.json, and the Qwen 3-MoE models'): q/k norms, head_dim 128, untied head.
QWEN3 = dict(
    family="qwen3",
    head_dim=128,
    vocab_size=151936,
    seq_len=4096,
    max_position_embeddings=40960,
    position_embedding="rope",
    rope_theta=1000000.0,
    norm="rmsnorm",
    layernorm_eps=1e-6,
    mlp="swiglu",
    qk_norm=True,
    bias=False,
    tie_embeddings=False,
    init_std=0.02,
)
# Qwen 3-MoE (Qwen3-30B-A3B and 235B-A22B's config.json): the Qwen 3 block, 128 experts, 8 per token renormalised.
QWEN3_MOE = dict(QWEN3, family="qwen3_moe", norm_topk_prob=True, router_aux_loss_coef=0.001)
# Mixtral (8x7B and 8x22B's config.json): the Llama block, 8 experts of ffn_hidden_size, 2 per token.
MIXTRAL = dict(
    family="mixtral",
    **ROPE_BLOCK,
    **dict(vocab_size=32000, seq_len=4096, rope_theta=1000000.0, init_std=0.02),
    **dict(num_experts=8, experts_per_token=2, norm_topk_prob=True, router_aux_loss_coef=0.02),
)

# DeepSeek-V3's class (DeepSeek-V3's and Kimi K2's config.json): multi-head latent attention (a 1536 query latent,
# a 512 key/value latent, 128 + 64 rotary q/k dims, 128 value dims), YaRN, sigmoid routing with 8 experts per token
# and a shared expert, the router's balancing bias. Their multi-token-prediction layer is not part of the model.
DEEPSEEK_V3 = dict(
    family="deepseek_v3",
    **ROPE_BLOCK,
    **dict(num_layers=61, hidden_size=7168, head_dim=192, ffn_hidden_size=18432, seq_len=4096, layernorm_eps=1e-6),
    **dict(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True),
    **dict(experts_per_token=8, moe_ffn_hidden_size=2048, shared_expert_ffn_hidden_size=2048, norm_topk_prob=True),
    init_std=0.006,
)
# GLM-4.5's class (GLM-4.5's and GLM-4.5-Air's config.json): grouped-query attention (96 query heads of 128, 8
# key/value heads) with q/k/v biases and half of each head rotating, DeepSeek-V3's routing without groups.
GLM4_MOE = dict(
    family="glm4_moe",
    **ROPE_BLOCK,
    **dict(num_heads=96, num_kv_heads=8, head_dim=128, qkv_bias=True, partial_rotary_factor=0.5, seq_len=4096),
    **dict(vocab_size=151552, rope_theta=1000000.0, max_position_embeddings=131072, init_std=0.02),
    **dict(experts_per_token=8, norm_topk_prob=True),
)
GPT_OSS = dict(
    family="gpt_oss",
    **dict(hidden_size=2880, num_heads=64, num_kv_heads=8, head_dim=64, ffn_hidden_size=2880, moe_ffn_hidden_size=2880),
    **dict(vocab_size=201088, seq_len=8192, max_position_embeddings=131072, layernorm_eps=1e-5, tie_embeddings=False),
    rope_theta=150000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(36)],
    **dict(sliding_window=128, experts_per_token=4, swiglu_alpha=1.702, swiglu_limit=7.0, init_std=0.02),
)

PRESETS: dict[str, dict] = {
    # Table/Section 3 of the MT-NLG paper.
    "mtnlg-530b": dict(family="gpt", num_layers=105, hidden_size=20480, num_heads=128, seq_len=2048),
    # GPT-3 paper, Table 2.1 (heads of the 1.3B model as Megatron runs it: 16 x 128).
    "gpt3-175b": dict(family="gpt", num_layers=96, hidden_size=12288, num_heads=96, seq_len=2048),
    "gpt3-1.3b": dict(family="gpt", num_layers=24, hidden_size=2048, num_heads=16, seq_len=2048),
    "gpt3-125m": dict(family="gpt", num_layers=12, hidden_size=768, num_heads=12, seq_len=2048),
    # The offline demo: big enough to visibly learn the built-in corpus on 2 CPU cores in minutes.
    "demo": dict(family="gpt", num_layers=4, hidden_size=256, num_heads=4, seq_len=128, vocab_size=4096),
    # Seconds-scale model for tests and every parallel-equivalence check.
    "tiny": dict(family="gpt", num_layers=2, hidden_size=64, num_heads=4, seq_len=64, vocab_size=4096),
    # Today's dense families, with the published shapes (parameter counts equal the Hugging Face models').
    "llama3.2-1b": {
        **LLAMA_31,
        **dict(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, ffn_hidden_size=8192),
        "tie_embeddings": True,
        "seq_len": 8192,
        "rope_scaling": {**LLAMA_31["rope_scaling"], "factor": 32.0},
    },
    "llama3.1-8b": {
        **LLAMA_31,
        **dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336, seq_len=8192),
    },
    "llama3.1-70b": {
        **LLAMA_31,
        **dict(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672, seq_len=8192),
    },
    "llama3.1-405b": {
        **LLAMA_31,
        **dict(num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8, ffn_hidden_size=53248, seq_len=8192),
    },
    "qwen3-8b": dict(
        **QWEN3, **dict(num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=12288)
    ),
    # Mixtures of experts, with the published shapes (parameter counts equal the Hugging Face models').
    "qwen3-30b-a3b": dict(
        **QWEN3_MOE,
        **dict(num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4, ffn_hidden_size=6144),
        **dict(num_experts=128, experts_per_token=8, moe_ffn_hidden_size=768),
    ),
    "qwen3-235b-a22b": dict(
        **QWEN3_MOE,
        **dict(num_layers=94, hidden_size=4096, num_heads=64, num_kv_heads=4, ffn_hidden_size=12288),
        **dict(num_experts=128, experts_per_token=8, moe_ffn_hidden_size=1536),
    ),
    "mixtral-8x7b": dict(
        **MIXTRAL,
        **dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336),
        max_position_embeddings=32768,
    ),
    "mixtral-8x22b": dict(
        **MIXTRAL,
        **dict(num_layers=56, hidden_size=6144, num_heads=48, num_kv_heads=8, ffn_hidden_size=16384),
        max_position_embeddings=65536,
    ),
    "olmoe-1b-7b": dict(  # OLMoE-1B-7B-0924's config.json: q/k norms over the projections, 64 experts, 8 per token
        family="olmoe",
        **ROPE_BLOCK,
        **dict(num_layers=16, hidden_size=2048, num_heads=16, ffn_hidden_size=1024, vocab_size=50304, seq_len=4096),
        **dict(qk_norm=True, qk_norm_over="projection", init_std=0.02),
        **dict(num_experts=64, experts_per_token=8, router_aux_loss_coef=0.01),
    ),
    "deepseek-v3": dict(  # DeepSeek-V3 (and R1): 256 experts in 8 groups, 4 kept per token, the first 3 blocks dense
        **DEEPSEEK_V3,
        **dict(num_heads=128, vocab_size=129280, num_experts=256, expert_groups=8, expert_groups_per_token=4),
        **dict(first_dense_layers=3, routed_scaling_factor=2.5, max_position_embeddings=163840),
        rope_scaling={
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),  # fmt: skip
    "kimi-k2": dict(  # Kimi K2: DeepSeek-V3's block with 64 heads, 384 experts without groups, 1 dense block
        **DEEPSEEK_V3,
        **dict(num_heads=64, vocab_size=163840, num_experts=384, first_dense_layers=1, routed_scaling_factor=2.827),
        **dict(rope_theta=50000.0, max_position_embeddings=131072),
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),  # fmt: skip
    "glm-4.5": dict(  # GLM-4.5: 92 blocks (the first 3 dense), 160 experts, q/k norms
        **GLM4_MOE,
        **dict(num_layers=92, hidden_size=5120, ffn_hidden_size=12288, layernorm_eps=1e-5, qk_norm=True),
        **dict(num_experts=160, moe_ffn_hidden_size=1536, shared_expert_ffn_hidden_size=1536),
        **dict(first_dense_layers=3, routed_scaling_factor=2.5),
    ),
    "glm-4.5-air": dict(  # GLM-4.5-Air: 46 blocks (the first dense), 128 experts, no q/k norms
        **GLM4_MOE,
        **dict(num_layers=46, hidden_size=4096, ffn_hidden_size=10944, layernorm_eps=1e-5, qk_norm=False),
        **dict(num_experts=128, moe_ffn_hidden_size=1408, shared_expert_ffn_hidden_size=1408, first_dense_layers=1),
    ),
    # Attention kinds per layer (`attention_kinds.py`), with the published shapes (counts equal transformers').
    # Gemma 3 27B's text model (gemma-3-27b-pt's text_config): 5 sliding layers of 1024 keys to 1 global, the local
    # RoPE base 10000 and the global 1e6 with linear scaling 8; query_pre_attn_scalar 168 (hidden / heads).
    "gemma-3-27b": dict(
        family="gemma3_text",
        **dict(num_layers=62, hidden_size=5376, num_heads=32, num_kv_heads=16, head_dim=128, ffn_hidden_size=21504),
        **dict(vocab_size=262208, make_vocab_size_divisible_by=64, seq_len=8192, max_position_embeddings=131072),
        **dict(rope_theta=1_000_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}, layernorm_eps=1e-6),
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)],
        **dict(sliding_window=1024, sliding_rope_theta=10_000.0, attention_softmax_scale=168**-0.5),
        **dict(tie_embeddings=True, init_std=0.02),
    ),
    # GPT-OSS 20B and 120B (their config.json): 128-key sliding layers alternating with full ones from layer 0,
    # sinks, YaRN x32 over 4096 positions, top 4 of 32 / 128 biased experts with the clamped SwiGLU.
    "gpt-oss-20b": dict(GPT_OSS, num_layers=24, num_experts=32, layer_types=GPT_OSS["layer_types"][:24]),
    "gpt-oss-120b": dict(GPT_OSS, num_layers=36, num_experts=128),
    # Qwen3-Next 80B-A3B (its config.json): 3 Gated DeltaNet layers (16 key heads, 32 value heads of 128) to 1 gated
    # attention (16 heads of 256 over 2 key/value heads, a quarter of each rotated), 512 experts, 10 per token, a
    # shared expert.
    "qwen3-next-80b-a3b": dict(
        family="qwen3_next",
        **dict(num_layers=48, hidden_size=2048, num_heads=16, num_kv_heads=2, head_dim=256, ffn_hidden_size=5120),
        **dict(vocab_size=151936, seq_len=8192, max_position_embeddings=262144, layernorm_eps=1e-6),
        **dict(rope_theta=10_000_000.0, partial_rotary_factor=0.25, tie_embeddings=False, init_std=0.02),
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)],
        **dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128),
        linear_conv_kernel_dim=4,
        **dict(num_experts=512, experts_per_token=10, moe_ffn_hidden_size=512, shared_expert_ffn_hidden_size=512),
        norm_topk_prob=True,
    ),
    # The offline Llama-style demo (configs/demo_llama.yaml): the demo's size in the Llama 3 block.
    "demo-llama": {
        **LLAMA_31,
        **dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, ffn_hidden_size=688, seq_len=128),
        "vocab_size": 4096,
        "max_position_embeddings": 1024,
        "rope_scaling": {**LLAMA_31["rope_scaling"], "original_max_position_embeddings": 256},
    },
    # Seconds-scale Llama 3 block (GQA 4:2, Llama 3 RoPE scaling, untied head) for tests.
    "tiny-llama": {
        **LLAMA_31,
        **dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=160, seq_len=64),
        "vocab_size": 4096,
        "max_position_embeddings": 1024,
        "rope_scaling": {**LLAMA_31["rope_scaling"], "original_max_position_embeddings": 128},
    },
}


def deep_merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`, recursing into nested dicts (as YAML configs and DeepSpeed overrides combine)."""
    out = dict(base)
    for key, value in extra.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = deep_merge(out[key], value) if both else value
    return out


def fields_from(cls, source, **given):
    """A `cls` (a dataclass of settings) filled from `source`: each field from the attribute of the same name (the
    parsed flags of a command, a job's config), unless `given` names its value."""
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**{n: given[n] if n in given else getattr(source, n) for n in names if n in given or hasattr(source, n)})


def reject_unknown_fields(values: dict, cls, what: str) -> None:
    """One line naming the keys of `values` that are no field of the dataclass `cls`, and the valid ones."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise MTNLGError(f"{what} {unknown}; valid fields: {sorted(known)}")


def typed_overrides(overrides: dict, fields=None) -> dict:
    """Overrides in their fields' types (of the dataclass `fields`, default ModelConfig): on the command line
    `--model.model_overrides.num_layers 4` arrives as the string "4" (a dict's value types are unknown to the
    parser), so a string for a field that is not a string is read as YAML ("4" -> 4, "0.01" -> 0.01, "null" -> None,
    "true" -> True)."""
    hints = typing.get_type_hints(fields or ModelConfig)
    return {
        key: _yaml_value(value) if isinstance(value, str) and hints.get(key, str) is not str else value
        for key, value in overrides.items()
    }


def _yaml_value(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # not YAML: left as typed, for the field's own check to name


def preset_values(preset: str, overrides: dict) -> dict:
    """The `ModelConfig` fields of a preset with field overrides (checked by name, typed as their fields)."""
    if preset not in PRESETS:
        raise MTNLGError(f"unknown model preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    reject_unknown_fields(overrides, ModelConfig, "unknown model config field(s)")
    overrides = typed_overrides(overrides)
    # The position table belongs to the preset (as it would to a checkpoint): a longer seq_len is an error.
    return {"max_position_embeddings": PRESETS[preset]["seq_len"], **PRESETS[preset], **overrides, "name": preset}


def get_config(preset: str, **overrides) -> ModelConfig:
    """Build a config from a preset name, with field overrides (e.g. num_layers=5; family=qwen3 for another family,
    or family=None for a custom block)."""
    return ModelConfig(**preset_values(preset, overrides))
