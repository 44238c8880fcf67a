"""Local stand-ins for downloaded models, built offline: a vocabulary-1000 BPE, a random GPT-2 directory (3 layers,
4 heads, vocabulary not a multiple of 128). The tiny runs the session trains are in tiny_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mtnlg_lightning.config import LLAMA_31
from mtnlg_lightning.data.tokenizer import Tokenizer, train_bpe
from mtnlg_lightning.demo.builtin_corpus import build_demo_data
from mtnlg_lightning.demo.synthetic.demo_corpus import demo_dir

RANDOM_GPT2 = dict(vocab_size=1000, n_positions=64, n_embd=64, n_layer=3, n_head=4)


def demo_texts(count: int) -> list[str]:
    build_demo_data(progress=False)
    with open(demo_dir() / "python_docs.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f.readlines()[:count]]


def small_tokenizer(directory: Path) -> Tokenizer:
    tokenizer = train_bpe(demo_texts(200), RANDOM_GPT2["vocab_size"], directory)
    assert tokenizer.vocab_size == RANDOM_GPT2["vocab_size"]
    return tokenizer


def random_gpt2_dir(directory: Path, seed: int = 0) -> Path:
    """A random `GPT2LMHeadModel` saved with `save_pretrained`, plus its tokenizer.json. Every tensor (biases and
    LayerNorms included) is perturbed so a mapping mistake anywhere changes the logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = small_tokenizer(directory / "tokenizer")
    torch.manual_seed(seed)
    config = GPT2Config(
        **RANDOM_GPT2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eod_id,
        eos_token_id=tokenizer.eod_id,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    out = directory / "gpt2-random"
    model.save_pretrained(out)
    tokenizer.save(out / "tokenizer.json")
    return out


# The size of the Llama 3 and Qwen 3 blocks below: grouped-query attention (4 query heads, 2 key/value heads), the
# demo vocabulary.
TEST_BLOCK = {
    "vocab_size": 4096,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
# A Llama 3 block at test size: Llama 3's RoPE scaling (with an original context short enough that every frequency
# band is exercised), untied head.
RANDOM_LLAMA = dict(
    TEST_BLOCK,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={**LLAMA_31["rope_scaling"], "original_max_position_embeddings": 64},
    tie_word_embeddings=False,
)
# A Qwen 3 block at test size: q/k norms, head_dim (32) not hidden / heads (16), tied head.
RANDOM_QWEN3 = dict(TEST_BLOCK, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True)


def random_family_dir(directory: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A random `LlamaForCausalLM` ("llama") or `Qwen3ForCausalLM` ("qwen3") saved with `save_pretrained`, with the
    demo tokenizer (its end-of-text token as bos/eos). The norms' weights are perturbed away from 1 so a norm
    mapped to the wrong tensor changes the logits."""
    import transformers

    _, tokenizer_path = build_demo_data(progress=False)
    tokenizer = Tokenizer(tokenizer_path)
    torch.manual_seed(seed)
    ids = dict(bos_token_id=tokenizer.eod_id, eos_token_id=tokenizer.eod_id)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**RANDOM_LLAMA, **overrides}, **ids))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**RANDOM_QWEN3, **overrides}, **ids))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    out = directory / f"{family}-random"
    model.eval().save_pretrained(out)
    tokenizer.save(out / "tokenizer.json")
    return out


# Mixtures of experts at test size (the demo vocabulary, grouped-query attention 4:2 where the family has it):
# 4 experts, 2 per token. Qwen 3-MoE keeps layer 1 of 3 dense (mlp_only_layers) and renormalises the top k; Qwen
# 2-MoE has a shared expert; Mixtral renormalises by design; OLMoE norms the whole q and k projections.
MOE_BLOCK = dict(TEST_BLOCK, num_hidden_layers=3, num_experts_per_tok=2, rope_theta=10000.0)
RANDOM_MOE = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(MOE_BLOCK, head_dim=32, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(MOE_BLOCK, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    ),
    "mixtral": ("MixtralConfig", dict(MOE_BLOCK, head_dim=16, num_local_experts=4, intermediate_size=32)),
    "olmoe": ("OlmoeConfig", dict(MOE_BLOCK, head_dim=16, num_key_value_heads=4, num_experts=4, intermediate_size=32)),
}


def random_moe_dir(directory: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A random mixture of experts of `family` (a key of RANDOM_MOE) saved with `save_pretrained` (one tensor per
    expert, as shipped), with the demo tokenizer. Every tensor is perturbed (norms away from 1, biases and routers
    away from their zero start) so a mapping mistake anywhere changes the logits."""
    import transformers

    _, tokenizer_path = build_demo_data(progress=False)
    tokenizer = Tokenizer(tokenizer_path)
    torch.manual_seed(seed)
    config_class, values = RANDOM_MOE[family]
    config = getattr(transformers, config_class)(
        **{**values, **overrides}, bos_token_id=tokenizer.eod_id, eos_token_id=tokenizer.eod_id
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.add_(torch.randn_like(param) * 0.05)
    out = directory / f"{family}-random"
    model.eval().save_pretrained(out)
    tokenizer.save(out / "tokenizer.json")
    return out


def exported_logits_gap(checkpoint: Path, exported: Path, length: int = 64) -> float:
    """Largest |logit| difference between our model from `checkpoint` and transformers' from the directory
    `mtnlg-export-hf` wrote of it (`exported`), over 2 random rows of `length` tokens of the 4096-token vocabulary."""
    import transformers

    from mtnlg_lightning.inference.load import load_model

    tokens = torch.randint(0, 4096, (2, length), generator=torch.Generator().manual_seed(0))
    ours, _ = load_model(checkpoint)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        return (theirs(tokens).logits - ours(tokens)[..., :4096]).abs().max().item()


# Gemma 3 at test size: 6 layers (layer 5 the full one), a window of 8 keys (rows of 40), query_pre_attn_scalar not
# head_dim, 4 query heads over 2 key/value heads.
RANDOM_GEMMA3 = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=8,
    max_position_embeddings=256,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
)


# GPT-OSS at test size: 4 layers alternating sliding (window 8) and full from layer 0, sinks, YaRN (factor 32 over an
# original context of 16, so every band of frequencies is exercised in rows of 40), biased q/k/v/o, 4 experts with
# biases and the clamped SwiGLU (its limit low enough to clip), 2 per token.
RANDOM_GPT_OSS = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    swiglu_limit=0.3,  # small enough that the clamps bite at this size (the published 7.0 at full size)
    sliding_window=8,
    max_position_embeddings=512,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
        "rope_theta": 150000.0,
    },
)
# Qwen3-Next at test size: 4 layers, three Gated DeltaNet (2 key heads of 8 dims, 4 value heads of 16) to one gated
# full attention (partial RoPE 0.25), 4 experts (2 per token) and a shared expert in every layer.
RANDOM_QWEN3_NEXT = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    max_position_embeddings=256,
)
# The families of attention kinds (test_attention_kinds.py): family -> (transformers config class, its values).
ATTENTION_KIND_FAMILIES = {
    "gemma3_text": ("Gemma3TextConfig", RANDOM_GEMMA3),
    "gpt_oss": ("GptOssConfig", RANDOM_GPT_OSS),
    "qwen3_next": ("Qwen3NextConfig", RANDOM_QWEN3_NEXT),
}


def random_attention_kind_dir(directory: Path, family: str, seed: int = 0, noise: float = 0.1) -> Path:
    """A random model of `family` (a key of ATTENTION_KIND_FAMILIES) saved with `save_pretrained`, with the demo
    tokenizer; every tensor perturbed (Gemma's norms start at 0, the identity; biases and sinks at 0) so a mapping
    mistake anywhere changes the logits. `noise`: the perturbation's scale (a training comparison wants gradients
    well conditioned: Adam magnifies the rounding of the ones near its epsilon)."""
    import transformers

    config_class, values = ATTENTION_KIND_FAMILIES[family]
    _, tokenizer_path = build_demo_data(progress=False)
    tokenizer = Tokenizer(tokenizer_path)
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(
        **values, bos_token_id=tokenizer.eod_id, eos_token_id=tokenizer.eod_id, pad_token_id=None
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * noise)
    out = directory / f"{family}-random"
    model.eval().save_pretrained(out)
    tokenizer.save(out / "tokenizer.json")
    return out
