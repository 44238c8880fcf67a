"""Hugging Face interop is proven equal, not assumed: logits and greedy text against transformers, exact round trips,
and `--model.init_from` training the same under tensor parallelism as in one process."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import RANDOM_GPT2, demo_texts, random_gpt2_dir
from tiny_runs import tiny_checkpoint as trained_tiny_checkpoint

from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.demo.builtin_corpus import build_demo_data
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.inference.decode import generate
from mtnlg_lightning.inference.generate_cli import main as generate_main
from mtnlg_lightning.inference.load import load_model, use_generation_layout
from mtnlg_lightning.interop.export_cli import main as export_main
from mtnlg_lightning.interop.hf import export_hf, read_hf_dir
from mtnlg_lightning.model import KVCache
from mtnlg_lightning.train.module import MTNLGModule

transformers = pytest.importorskip("transformers")
PROMPTS = ["Return the value of", "The default is", "If the file does not exist,"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return random_gpt2_dir(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module", params=["single", pytest.param("tp2xpp2xdp2", marks=pytest.mark.distributed)])
def tiny_checkpoint(tmp_path_factory, request):
    """A checkpoint of one process, and one of 8 ranks (tp2 x pp2 x dp2 ZeRO-1): both export alike."""
    return trained_tiny_checkpoint(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def exported_tiny(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny-hf"
    assert export_main([str(tiny_checkpoint), str(out), "--tokenizer", build_demo_data(progress=False)[1]]) == 0
    return out


def hf_logits(model_dir, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(tokens).logits


def our_logits(source, tokens, vocab):
    model, _ = load_model(source)
    with torch.no_grad():
        return model(tokens)[..., :vocab]


def test_random_gpt2_imports_with_equal_logits(hf_dir):
    tokens = torch.randint(0, RANDOM_GPT2["vocab_size"], (4, RANDOM_GPT2["n_positions"]), generator=torch.Generator())
    ours, theirs = our_logits(hf_dir, tokens, 1000), hf_logits(hf_dir, tokens)
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_init_from_loads_the_source_into_the_module_with_padded_vocabulary(hf_dir):
    module = MTNLGModule(preset="tiny", init_from=str(hf_dir))
    module.configure_model()
    assert module.config.num_layers == 3 and module.config.vocab_size == 1000
    assert module.model.embed.wte.weight.shape[0] == 1024  # padded to a multiple of 128 for the layout
    tokens = torch.randint(0, 1000, (2, 64))
    with torch.no_grad():
        ours = module.model(tokens)
    assert (ours[..., :1000] - hf_logits(hf_dir, tokens)).abs().max().item() <= 1e-4
    assert torch.count_nonzero(module.model.embed.wte.weight[1000:]) == 0  # no token maps to the padding
    # A checkpoint of this run rebuilds the same config from its hparams (preset + resolved overrides).
    assert module.hparams.model_overrides["num_layers"] == 3


def test_import_then_export_gives_back_the_original_tensors_exactly(hf_dir, tmp_path):
    from safetensors.torch import load_file

    export_hf(read_hf_dir(hf_dir), tmp_path / "again")
    original, again = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(again) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(again[name], tensor), name


def test_import_writes_the_family_and_export_writes_the_family_the_config_names(hf_dir, tmp_path):
    """The imported config names its family (from `model_type`); the export reads that name, and a custom block (no
    family) has no Hugging Face form: one line, nothing written."""
    import dataclasses

    from hf_models import random_family_dir

    state = read_hf_dir(hf_dir)
    assert state.config.family == "gpt"
    assert read_hf_dir(random_family_dir(tmp_path, "qwen3")).config.family == "qwen3"
    assert export_hf(state, tmp_path / "gpt2")["family"] == "GPT-2"
    custom = dataclasses.replace(state, config=dataclasses.replace(state.config, family=None))
    with pytest.raises(MTNLGError, match="^a Hugging Face export needs a model family, and this model names none"):
        export_hf(custom, tmp_path / "custom")
    assert not (tmp_path / "custom").exists()


def test_checkpoint_exports_to_a_directory_transformers_loads_offline_with_equal_logits(tiny_checkpoint, exported_tiny):
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported_tiny)
    ours_tok = Tokenizer(build_demo_data(progress=False)[1])
    text = demo_texts(1)[0][:300]
    assert tokenizer(text)["input_ids"] == ours_tok.encode(text)
    assert tokenizer.eos_token_id == ours_tok.eod_id
    tokens = torch.randint(0, 4096, (4, 64))
    assert (our_logits(tiny_checkpoint, tokens, 4096) - hf_logits(exported_tiny, tokens)).abs().max().item() <= 1e-4


def test_greedy_generation_equals_transformers_generate_for_32_tokens(tiny_checkpoint, exported_tiny, capsys):
    ours_tok = Tokenizer(build_demo_data(progress=False)[1])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported_tiny).eval()
    model, _ = load_model(tiny_checkpoint, for_generation=True)  # as mtnlg-generate loads it
    for prompt in PROMPTS:
        ids = ours_tok.encode(prompt)
        theirs = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=ours_tok.eod_id
        )[0, len(ids) :].tolist()
        ours = generate(model, ids, 32, temperature=0, eos_id=ours_tok.eod_id)
        ended = ours_tok.eod_id in theirs  # transformers keeps the end-of-text token, ours reports it as the stop
        assert ours.tokens[0] == (theirs[: theirs.index(ours_tok.eod_id)] if ended else theirs)
        assert ours.stop == ["<|endoftext|>" if ended else "max-new-tokens"]
    # The CLI prints the same greedy text (prompt + continuation), from the exported directory too.
    argv = ["--prompt", PROMPTS[0], "--temperature", "0", "--max-new-tokens", "32"]
    assert generate_main(["--checkpoint", str(exported_tiny), *argv]) == 0
    printed = capsys.readouterr().out
    greedy = generate(model, ours_tok.encode(PROMPTS[0]), 32, temperature=0, eos_id=ours_tok.eod_id).tokens[0]
    assert printed == PROMPTS[0] + ours_tok.decode(greedy) + "\n"


def test_kv_cache_and_recomputing_the_prefix_give_the_same_tokens(hf_dir):
    model, _ = load_model(hf_dir)
    cached = generate(model, [5, 6, 7], 20, temperature=0.9, top_k=50, top_p=0.9, num_samples=3, seed=3)
    recomputed = generate(model, [5, 6, 7], 20, temperature=0.9, top_k=50, top_p=0.9, num_samples=3, seed=3,
                          use_cache=False)  # fmt: skip
    assert cached.tokens == recomputed.tokens
    assert len({tuple(t) for t in cached.tokens}) == 3  # the samples differ


def test_generation_layout_and_cached_decoding_compute_the_model_s_logits(hf_dir):
    model, _ = load_model(hf_dir)
    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = model(tokens)[..., :1000]
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        use_generation_layout(model)
        after = model.state_dict()
        assert all(torch.equal(after[name], tensor) for name, tensor in before.items())  # same values and shapes
        assert model.lm_head.weight is model.embed.wte.weight  # still tied
        assert model.blocks["0"].attn.qkv.weight.t().is_contiguous() and model.lm_head.weight.t().is_contiguous()
        assert (model(tokens)[..., :1000] - reference).abs().max().item() <= 1e-5
        # Decoding runs the same forward with a KV cache: a prefill of 8 positions, then one position at a time.
        cache = KVCache(24)
        logits = [model(tokens[:, :8], cache)]
        for t in range(8, 24):
            cache.start = t
            logits.append(model(tokens[:, t : t + 1], cache))
    assert logits[0].shape == (2, 1, 1024)  # the last position only, over the padded vocabulary
    steps = [step[:, 0, :1000] for step in logits]
    assert max((step - reference[:, 7 + i]).abs().max().item() for i, step in enumerate(steps)) <= 1e-4


def test_generation_stops_at_the_position_limit_with_a_note(hf_dir, capsys):
    code = generate_main(["--checkpoint", str(hf_dir), "--prompt", "Return the value", "--max-new-tokens", "500"])
    assert code == 0
    err = capsys.readouterr().err
    assert "[stopped at the position limit of 64]" in err


def test_source_without_tokenizer_still_exports_the_model_and_says_so(hf_dir, tmp_path, capsys):
    import shutil

    bare = tmp_path / "no-tokenizer"
    shutil.copytree(hf_dir, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    assert export_main([str(bare), str(tmp_path / "out")]) == 0
    assert "names no tokenizer" in capsys.readouterr().err
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.n_layer == 3


def test_bad_sources_are_one_line(tmp_path, capsys):
    other = tmp_path / "mamba"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}')
    assert generate_main(["--checkpoint", str(other), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"mtnlg-generate: error: {other} holds a 'mamba' model (MambaForCausalLM); the architectures that can be "
        f"read are deepseek_v3, gemma3_text, glm4_moe, gpt2, gpt_oss, llama, mixtral, olmoe, qwen2, qwen2_moe, qwen3, "
        f"qwen3_moe, qwen3_next"
    )
    garbage = tmp_path / "broken.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    assert export_main([str(garbage), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mtnlg-export-hf: error: {garbage} is not a readable checkpoint")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_init_from_conflicting_with_overrides_or_preset_is_one_line(hf_dir):
    with pytest.raises(MTNLGError, match=r"^model_overrides num_layers=5 conflicts with .* \(num_layers=3\)"):
        MTNLGModule(preset="tiny", model_overrides={"num_layers": 5}, init_from=str(hf_dir))
    with pytest.raises(MTNLGError, match=r"^seq_len 2048 \(preset 'gpt3-125m'\) is above the 64 positions"):
        MTNLGModule(preset="gpt3-125m", init_from=str(hf_dir))


@pytest.mark.distributed
def test_fit_init_from_trains_the_same_under_tp2_as_in_one_process(hf_dir, tmp_path):
    from test_strategy_cli import fit_single_and_parallel

    from mtnlg_lightning.data.preprocess import preprocess_jsonl

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in demo_texts(60)), encoding="utf-8")
    preprocess_jsonl(str(corpus), str(hf_dir), str(tmp_path / "data"), progress=False)  # its tokenizer, as a dir
    data = ["--data.builtin_corpus", "null", "--data.datasets", f"[{tmp_path / 'data'}]"]
    reference, _, _ = fit_single_and_parallel(
        tmp_path, "configs/strategy/tp2.yaml", 2, 5, both=("--model.init_from", str(hf_dir), *data)
    )
    assert len(reference) == 5


def test_init_from_a_project_checkpoint_starts_from_its_weights(tiny_checkpoint):
    module = MTNLGModule(preset="tiny", init_from=str(tiny_checkpoint))
    module.configure_model()
    reference, _ = load_model(tiny_checkpoint)
    for (name, ours), (_, theirs) in zip(module.model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(ours, theirs), name
