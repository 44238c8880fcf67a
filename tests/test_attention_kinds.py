"""Attention kinds per layer (`attention_kinds.py`), proven against transformers: a random Gemma 3 (five sliding
layers with their own RoPE base to one full layer, windows shorter than the test rows, (1 + w) norms, four per block,
q/k norms, query_pre_attn_scalar, a scaled embedding, a tanh-GELU MLP, tied head) gives transformers' logits and
greedy text (the cached decode past the window), exports back to a directory transformers loads as the same class
with our logits, and a packed row of three documents is each document alone, windows included."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.demo.builtin_corpus import build_demo_data
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.inference.decode import generate
from mtnlg_lightning.inference.load import load_model
from mtnlg_lightning.interop.export_cli import main as export_main

transformers = pytest.importorskip("transformers")

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
FAMILIES = {
    "gemma3_text": ("Gemma3TextConfig", RANDOM_GEMMA3, "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", RANDOM_GPT_OSS, "GptOssForCausalLM"),
}


def random_hf_dir(directory, config_class: str, values: dict, name: str, seed: int = 0):
    """A random transformers model of `config_class` saved with `save_pretrained`, with the demo tokenizer; every
    tensor perturbed (Gemma's norms start at 0, the identity) so a mapping mistake anywhere changes the logits."""
    _, tokenizer_path = build_demo_data(progress=False)
    tokenizer = Tokenizer(tokenizer_path)
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(
        **values, bos_token_id=tokenizer.eod_id, eos_token_id=tokenizer.eod_id, pad_token_id=None
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    out = directory / name
    model.eval().save_pretrained(out)
    tokenizer.save(out / "tokenizer.json")
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    config_class, values, _ = FAMILIES[request.param]
    return random_hf_dir(tmp_path_factory.mktemp(request.param), config_class, values, f"{request.param}-random")


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def test_logits_equal_transformers_past_the_window(family_dir):
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(0))
    ours, _ = load_model(family_dir)
    assert ours.config.family in FAMILIES and "full_attention" in ours.config.layer_types
    with torch.no_grad():
        expected, got = hf_model(family_dir)(tokens).logits, ours(tokens)[..., :4096]
    assert (got - expected).abs().max().item() < 1e-5


def test_greedy_text_equals_transformers_with_the_cache_past_the_window(family_dir):
    tokenizer = Tokenizer(family_dir / "tokenizer.json")
    ids = tokenizer.encode("The value of the argument is")
    with torch.no_grad():
        made = hf_model(family_dir).generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eod_id
        )
    theirs = [t for t in made[0, len(ids) :].tolist() if t != tokenizer.eod_id]
    model, _ = load_model(family_dir, for_generation=True)
    ours = generate(model, ids, 24, temperature=0, eos_id=tokenizer.eod_id)
    assert ours.tokens[0] == theirs[: len(ours.tokens[0])] and len(ours.tokens[0]) == len(theirs)


def test_export_loads_as_the_same_class_with_our_logits(family_dir, tmp_path):
    out = tmp_path / "exported"
    assert export_main([str(family_dir), str(out)]) == 0
    written = json.loads((out / "config.json").read_text())
    source = json.loads((family_dir / "config.json").read_text())
    for key in (
        *("architectures", "layer_types", "sliding_window", "rope_parameters"),
        *("query_pre_attn_scalar", "swiglu_limit", "swiglu_alpha", "num_local_experts"),
    ):
        assert written.get(key) == source.get(key), key
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(1))
    ours, _ = load_model(family_dir)
    reloaded = hf_model(out)
    assert type(reloaded).__name__ == source["architectures"][0]
    with torch.no_grad():
        assert (reloaded(tokens).logits - ours(tokens)[..., :4096]).abs().max().item() < 1e-5


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_a_packed_row_of_three_documents_is_each_document_alone(family_dir, kernel, monkeypatch):
    """Sliding layers see their window within their document only, sinks join each document's softmax alone;
    positions restart per document."""
    model, _ = load_model(family_dir)
    lengths = (14, 9, 17)  # two longer than the window of 8, one shorter
    docs = [torch.randint(0, 4096, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    row = torch.cat(docs, dim=1)
    document_ids = torch.cat([torch.full((1, n), d) for d, n in enumerate(lengths)], dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    monkeypatch.setattr(model, "document_mask_kernel", kernel)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        packed = model(row, position_ids=position_ids, document_ids=document_ids)
        alone = torch.cat([model(doc) for doc in docs], dim=1)
    assert (packed - alone).abs().max().item() < 1e-5


def test_bad_layer_patterns_are_one_line():
    base = dict(num_layers=3, hidden_size=32, num_heads=4, seq_len=64, family=None)
    with pytest.raises(MTNLGError, match=r"^layer_types lists 2 layer kinds for a 3-layer model$"):
        ModelConfig(**base, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    with pytest.raises(MTNLGError, match=r"^layer_types has 'local', not one of full_attention, sliding_attention$"):
        ModelConfig(**base, layer_types=["local"] * 3, sliding_window=8)
    with pytest.raises(MTNLGError, match=r"^sliding_attention layers need sliding_window >= 1"):
        ModelConfig(**base, layer_types=["sliding_attention"] * 3)
    with pytest.raises(MTNLGError, match=r"^sliding_window 64 is not smaller than seq_len 64: no query would lose"):
        ModelConfig(**base, layer_types=["sliding_attention"] * 3, sliding_window=64)
