"""Tiny random DeepSeek-V3 and GLM-4.5 directories, built offline (transformers' classes, the demo vocabulary):
the models of issue 61's checks (test_deepseek_v3.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.demo.builtin_corpus import build_demo_data

# 4 query heads, q/k heads of 8 dims without rotation + 8 rotary ones, values 12 wide (not the q/k width), a latent
# of 16; 8 experts of width 16 in 2 groups (1 kept per token), 2 per token, one shared expert; the first of three
# blocks dense; the router's scaling not 1.
DEEPSEEK_TINY = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=1024,
)
# YaRN with an attention factor other than 1 (mscale != mscale_all_dim) and the softmax scale's correction.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
YARN |= {"mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
# GLM-4.5 at test size: grouped-query attention 4:2, head_dim 32 with its first half rotating, q/k/v biases and
# q/k norms, DeepSeek's routing (2 groups, 2 kept: no limit in effect... 1 kept here to exercise it).
GLM_TINY = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    attention_bias=True,
    use_qk_norm=True,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.5,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
VARIANTS = {
    "deepseek_v3": ("DeepseekV3Config", DEEPSEEK_TINY),
    "deepseek_v3_no_q_lora": (
        "DeepseekV3Config",
        dict(DEEPSEEK_TINY, q_lora_rank=None, rope_parameters=YARN, max_position_embeddings=256),
    ),
    "glm4_moe": ("Glm4MoeConfig", GLM_TINY),
}


def random_deepseek_dir(directory: Path, variant: str, seed: int = 0, **overrides) -> Path:
    """A random model of `variant` (a key of VARIANTS) saved with `save_pretrained` (one tensor per expert), with
    the demo tokenizer. Every tensor is perturbed (norms away from 1, the routers' biases away from 0, so that they
    change which experts are chosen) so a mapping mistake anywhere changes the logits."""
    import transformers

    _, tokenizer_path = build_demo_data(progress=False)
    tokenizer = Tokenizer(tokenizer_path)
    torch.manual_seed(seed)
    config_class, values = VARIANTS[variant]
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
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.1, 0.1)
    out = directory / f"{variant}-random"
    model.eval().save_pretrained(out)
    tokenizer.save(out / "tokenizer.json")
    return out
