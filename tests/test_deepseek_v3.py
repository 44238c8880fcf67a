"""The DeepSeek-V3 class (issue 61), proven against transformers: tiny random `DeepseekV3ForCausalLM` directories
(multi-head latent attention with and without the query latent, interleaved rotary dims, YaRN with its attention
factor and softmax-scale correction, sigmoid routing with the balancing bias in 2 groups, ungated shared experts,
the first block dense) and a `Glm4MoeForCausalLM` one (grouped-query attention with q/k/v biases, q/k norms and half
of each head rotating, the same routing) give transformers' logits and greedy text, export back to the same class
and tensors, and cache MLA's latent when decoding."""

from __future__ import annotations

import json

import pytest
import test_model_families as dense_families
import torch
from deepseek_models import VARIANTS, random_deepseek_dir

from mtnlg_lightning.checkpoint.safetensors_shards import ShardedTensors
from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import count_parameters, family_of
from mtnlg_lightning.inference.load import load_model
from mtnlg_lightning.model import KVCache, build_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def family_dir(request, tmp_path_factory):
    return random_deepseek_dir(tmp_path_factory.mktemp(request.param), request.param)


def test_each_directory_reads_as_its_family_with_its_routing(family_dir):
    config = load_model(family_dir)[0].config
    source = json.loads((family_dir / "config.json").read_text())
    assert family_of(config).hf_model_type == source["model_type"]
    assert (config.num_experts, config.experts_per_token, config.expert_groups) == (8, 2, 2)
    assert config.expert_groups_per_token == 1 and config.moe_layers == (1, 2) and config.router == "sigmoid"
    assert config.routed_scaling_factor == source["routed_scaling_factor"] and not config.shared_expert_gate
    if source["model_type"] == "deepseek_v3":
        assert config.latent_attention and config.q_lora_rank == source["q_lora_rank"] and config.rope_interleave
        assert (config.head_dim, config.v_head_dim, config.rotary_dim) == (16, 12, 8)
    else:
        assert config.qk_norm and config.qkv_bias and config.rotary_dim == 16 and not config.latent_attention


def test_our_logits_equal_transformers(family_dir):
    dense_families.test_our_logits_equal_transformers(family_dir)


def test_greedy_generation_prints_transformers_continuation(family_dir, capsys):
    capsys.readouterr()  # transformers' progress bars
    dense_families.test_greedy_generation_prints_transformers_continuation(family_dir, capsys)


def test_export_writes_the_same_class_and_tensors_transformers_loads_with_our_logits(family_dir, tmp_path):
    dense_families.test_export_writes_the_family_transformers_loads_with_our_logits(family_dir, tmp_path)
    exported, source = ShardedTensors(tmp_path / "exported"), ShardedTensors(family_dir)
    assert sorted(exported.names) == sorted(source.names)  # per-expert keys, the routers' e_score_correction_bias
    for name in source.names:
        assert torch.equal(exported.read(name), source.read(name)), name
    written = json.loads((tmp_path / "exported" / "config.json").read_text())
    theirs = json.loads((family_dir / "config.json").read_text())
    for key in ("n_group", "topk_group", "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace"):
        assert written[key] == theirs[key], key
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "rope_interleave", "use_qk_norm"):
        assert written.get(key) == theirs.get(key), key


def test_the_mla_cache_holds_the_latent_and_the_rotary_key_only():
    config = get_config("tiny-llama", family=None, num_kv_heads=4, head_dim=24, kv_lora_rank=16, qk_rope_head_dim=8,
                        v_head_dim=20)  # fmt: skip
    model = build_model(config).eval()
    tokens = torch.randint(0, 4096, (3, 9), generator=torch.Generator().manual_seed(0))
    cache = KVCache(32)
    with torch.no_grad():
        model(tokens[:, :8], cache)
        cache.start = 8
        last = model(tokens[:, 8:], cache)
        whole = model(tokens)[:, -1:]
    torch.testing.assert_close(last, whole, rtol=1e-5, atol=1e-5)  # decoding from the latent cache = recomputing
    per_token = (16 + 8) * config.num_layers * 4  # (kv_lora_rank + qk_rope_head_dim) x layers x fp32
    full_heads = config.num_layers * config.num_heads * (24 + 20) * 4  # keys and values of every head
    assert cache.bytes_per_position() == per_token == 192 and full_heads == 1408
    assert all(k.shape == (3, 1, 32, 16) for k in cache.keys.values())


def test_the_meta_model_counts_transformers_parameters(family_dir):
    config = load_model(family_dir)[0].config
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(family_dir))
    assert count_parameters(config) - count_parameters(config, 1) == 0
    padded = (config.padded_vocab_size() - config.vocab_size) * config.hidden_size * (1 if config.tie_embeddings else 2)
    assert count_parameters(config) - padded == sum(p.numel() for p in theirs.parameters())


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(expert_groups=3), "expert_groups 3 does not divide num_experts 8"),
        (dict(expert_groups=2, expert_groups_per_token=3), "expert_groups_per_token 3 must be between 1 and"),
        (dict(expert_groups=4, expert_groups_per_token=1, experts_per_token=3), "experts_per_token 3 is more than"),
        (dict(qk_rope_head_dim=8), "set kv_lora_rank too"),
        (dict(kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, num_kv_heads=2), "num_kv_heads = num_heads"),
    ],
)
def test_bad_routing_and_latent_attention_settings_are_one_line(change, message):
    values = dict(family=None, num_experts=8, experts_per_token=2, moe_ffn_hidden_size=16, router="sigmoid")
    with pytest.raises(MTNLGError, match=message):
        get_config("tiny-llama", **{**values, "head_dim": 16, **change})
