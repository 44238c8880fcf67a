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


def add_mtp_layers(directory: Path, layers: int = 1, seed: int = 1) -> Path:
    """`directory` (a `random_deepseek_dir`) with `layers` multi-token prediction layers added as DeepSeek-V3's
    files hold them (transformers builds none): layer num_hidden_layers + k is a perturbed copy of the last decoder
    layer (its block) with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and the copies of the embedding and head
    (`embed_tokens`, `shared_head.head`); config.json's num_nextn_predict_layers says how many."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((directory / "config.json").read_text())
    last, hidden = config["num_hidden_layers"] - 1, config["hidden_size"]
    tensors = load_file(directory / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)

    def noise(shape) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * 0.05

    for depth in range(layers):
        layer = f"model.layers.{last + 1 + depth}."
        for name, tensor in list(tensors.items()):
            if name.startswith(f"model.layers.{last}."):
                tensors[name.replace(f"model.layers.{last}.", layer)] = tensor + noise(tensor.shape)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{layer}{norm}.weight"] = torch.rand(hidden, generator=generator) + 0.5
        tensors[f"{layer}eh_proj.weight"] = noise((hidden, 2 * hidden)) * 4
        tensors[f"{layer}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"{layer}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = layers
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
