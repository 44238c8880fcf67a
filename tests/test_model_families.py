"""Today's dense families are the one model with other options, proven against transformers: a random Llama 3
(grouped-query attention, Llama 3 RoPE scaling, untied head) and a random Qwen 3 (q/k norms, explicit head_dim,
tied head) give transformers' logits and greedy text, export back to directories transformers loads with our
logits, and the presets have the published shapes. Training them in every layout: test_model_families_layouts.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from hf_models import RANDOM_LLAMA, random_family_dir

from mtnlg_lightning.config import PRESETS, get_config
from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.evaluation.cli import main as eval_main
from mtnlg_lightning.families import count_parameters
from mtnlg_lightning.inference.generate_cli import main as generate_main
from mtnlg_lightning.inference.load import load_model
from mtnlg_lightning.interop import llama_mapping
from mtnlg_lightning.interop.export_cli import main as export_main
from mtnlg_lightning.model import KVCache, build_model

transformers = pytest.importorskip("transformers")
ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
FAMILIES = ["llama", "qwen3"]
# Hugging Face's parameter counts of the published models (their model cards / safetensors metadata).
PUBLISHED = {
    "llama3.2-1b": 1_235_814_400,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "qwen3-8b": 8_190_735_360,
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    return random_family_dir(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return random_family_dir(tmp_path_factory.mktemp("llama"), "llama")


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def test_our_logits_equal_transformers(family_dir):
    tokens = torch.randint(0, 4096, (2, 200), generator=torch.Generator().manual_seed(0))  # past the original 64
    ours, _ = load_model(family_dir)
    with torch.no_grad():
        expected, got = hf_model(family_dir)(tokens).logits, ours(tokens)[..., :4096]
    assert (got - expected).abs().max().item() < 1e-5


def test_greedy_generation_prints_transformers_continuation(family_dir, capsys):
    tokenizer = Tokenizer(family_dir / "tokenizer.json")
    prompt = "The value of the argument is"
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        made = hf_model(family_dir).generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tokenizer.eod_id)
    continuation = [t for t in made[0, ids.shape[1] :].tolist() if t != tokenizer.eod_id]
    argv = ["--checkpoint", str(family_dir), "--prompt", prompt, "--max-new-tokens", "24", "--temperature", "0"]
    assert generate_main([*argv, "--dtype", "fp32"]) == 0
    assert capsys.readouterr().out == prompt + tokenizer.decode(continuation) + "\n"


def test_export_writes_the_family_transformers_loads_with_our_logits(family_dir, tmp_path):
    out = tmp_path / "exported"
    assert export_main([str(family_dir), str(out), "--max-shard-size", "200KB"]) == 0
    written = json.loads((out / "config.json").read_text())
    source = json.loads((family_dir / "config.json").read_text())
    assert written["architectures"] == source["architectures"]
    for key in ("num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_parameters"):
        assert written.get(key) == source.get(key), key
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, 4096, (2, 100), generator=torch.Generator().manual_seed(1))
    ours, _ = load_model(family_dir)
    with torch.no_grad():
        assert (hf_model(out)(tokens).logits - ours(tokens)[..., :4096]).abs().max().item() < 1e-5


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(preset):
    config = get_config(preset)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(
            llama_mapping.hf_config(transformers, config, config.vocab_size, None, "float32")
        )
    assert count_parameters(config) == PUBLISHED[preset] == sum(p.numel() for p in theirs.parameters())


def test_the_planner_counts_the_published_parameters_of_every_new_preset():
    for preset in [*PUBLISHED, "tiny-llama", "demo-llama"]:
        out = subprocess.run(
            [sys.executable, str(ROOT / "tools/plan.py"), "--model", preset, "--tp", "1", "--pp", "1", "--dp", "1"]
            + ["--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["params_per_gpu"] == count_parameters(get_config(preset)), preset


def test_the_kv_cache_holds_key_value_heads_only():
    config = get_config("tiny-llama")  # 4 query heads, 2 key/value heads
    cache = KVCache(32)
    with torch.no_grad():
        build_model(config).eval()(torch.zeros(3, 8, dtype=torch.long), cache)
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # fp32, one sequence
    assert cache.bytes_per_position() == per_token == 512
    assert all(k.shape == (3, config.num_kv_heads, 32, config.head_dim) for k in cache.keys.values())


def test_every_preset_builds_on_the_meta_device_with_its_count():
    for preset in PRESETS:
        config = get_config(preset)
        model = build_model(config, "meta")
        assert sum(p.numel() for p in model.parameters()) == count_parameters(config), preset


# ------------------------------------------------------------------------------------------- bad input
def llama_variant(tmp_path, family_dir, change) -> str:
    copy = tmp_path / "variant"
    shutil.copytree(family_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    change(config)
    (copy / "config.json").write_text(json.dumps(config))
    for weights in copy.glob("*.safetensors"):  # any read of a weight would fail differently
        weights.write_bytes(weights.read_bytes()[:8])
    return str(copy)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.update(num_key_value_heads=3), "num_heads 4 is not divisible by num_kv_heads 3"),
        (
            lambda c: c["rope_parameters"].update(rope_type="longrope"),
            "rope_scaling of unknown type 'longrope'; known types: default, linear, llama3, yarn",
        ),
        (lambda c: c.update(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"]), "holds a 'gpt_neox' model"),
    ],
)
def test_a_bad_model_directory_is_one_line_before_any_weight_is_read(llama_dir, tmp_path, capsys, change, message):
    variant = llama_variant(tmp_path, llama_dir, change)
    assert generate_main(["--checkpoint", variant, "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtnlg-generate: error: ") and message in err[0], err


def test_a_tp_that_neither_divides_nor_is_a_multiple_of_the_kv_heads_is_one_line(tmp_path, capsys):
    six_heads = random_family_dir(tmp_path, "llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    capsys.readouterr()  # transformers' own progress bars
    strategy = tmp_path / "tp3.yaml"
    strategy.write_text(
        "class_path: mtnlg_lightning.train.strategy.MegatronDeepSpeedStrategy\ninit_args: {tensor_parallel: 3}\n"
    )
    argv = ["--checkpoint", str(six_heads), "--strategy", str(strategy), "--devices", "3", "--task", "perplexity"]
    assert eval_main([*argv, "--data", str(ROOT / "README.md")]) in (2,)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "mtnlg-eval: error: tensor_parallel 3 neither divides num_kv_heads 2 nor is a multiple of it (key/value "
        "heads are split over TP, or each replicated over TP / num_kv_heads ranks)"
    ]


def test_rope_llama3_scaling_is_transformers_own(llama_dir):
    """The frequencies themselves, against transformers' rotary module (the logits test covers their use)."""
    from mtnlg_lightning.interop.hf import read_hf_dir
    from mtnlg_lightning.model import rope_inverse_frequencies

    theirs = hf_model(llama_dir).model.rotary_emb.inv_freq
    assert torch.equal(rope_inverse_frequencies(read_hf_dir(llama_dir).config), theirs)
    assert RANDOM_LLAMA["rope_scaling"]["original_max_position_embeddings"] < 200  # the logits test goes past it
