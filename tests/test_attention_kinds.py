"""Attention kinds per layer (`attention_kinds.py`), proven against transformers: a random Gemma 3 (five sliding
layers with their own RoPE base to one full layer, windows shorter than the test rows, (1 + w) norms, four per block,
q/k norms, query_pre_attn_scalar, a scaled embedding, a tanh-GELU MLP, tied head) gives transformers' logits and
greedy text (the cached decode past the window), exports back to a directory transformers loads as the same class
with our logits, and a packed row of three documents is each document alone, windows included."""

from __future__ import annotations

import json
import queue
import threading
import warnings

import pytest
import torch
from hf_models import ATTENTION_KIND_FAMILIES, random_attention_kind_dir

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.inference.decode import generate
from mtnlg_lightning.inference.load import load_model
from mtnlg_lightning.interop.export_cli import main as export_main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=list(ATTENTION_KIND_FAMILIES))
def family_dir(request, tmp_path_factory):
    return random_attention_kind_dir(tmp_path_factory.mktemp(request.param), request.param)


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def test_logits_equal_transformers_past_the_window(family_dir):
    """Rows of 150: past the windows of 8, and three of Gated DeltaNet's chunks of 64; within 1e-5 of the logits'
    scale (Qwen3-Next at this perturbation: 1.5e-5 at a scale of 4.2, the next test says why)."""
    tokens = torch.randint(0, 4096, (2, 150), generator=torch.Generator().manual_seed(0))
    ours, _ = load_model(family_dir)
    assert ours.config.family in ATTENTION_KIND_FAMILIES and "full_attention" in ours.config.layer_types
    with torch.no_grad():
        expected, got = hf_model(family_dir)(tokens).logits, ours(tokens)[..., :4096]
    assert (got - expected).abs().max().item() < 1e-5 * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("family", list(ATTENTION_KIND_FAMILIES))
def test_logits_are_within_1e_5_of_transformers_on_a_milder_perturbation(family, tmp_path):
    """The same rows, absolute 1e-5, every tensor perturbed at 0.05 instead of 0.1. At 0.1 Qwen3-Next's random Gated
    DeltaNet layers magnify rounding about 4x each: our chunked rule (a triangular solve) and transformers' (a row
    by row substitution) differ by 2.8e-7 on one layer's output from the same input, 1.5e-5 on the logits after
    three (scale 4.2); at 0.05 1.4e-6."""
    directory = random_attention_kind_dir(tmp_path, family, noise=0.05)
    tokens = torch.randint(0, 4096, (2, 150), generator=torch.Generator().manual_seed(0))
    ours, _ = load_model(directory)
    with torch.no_grad():
        expected, got = hf_model(directory)(tokens).logits, ours(tokens)[..., :4096]
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
    if "linear_attention" in model.config.layer_types:  # the control: Gated DeltaNet not restarted per document
        import mtnlg_lightning.linear_attention as linear_attention

        monkeypatch.setattr(linear_attention, "document_runs", lambda ids, rows, length: [(0, 0, length)])
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            leaking = model(row, position_ids=position_ids, document_ids=document_ids)
        assert (leaking - alone)[:, lengths[0] :].abs().max().item() > 1e-3


def test_bad_layer_patterns_are_one_line():
    base = dict(num_layers=3, hidden_size=32, num_heads=4, seq_len=64, family=None)
    with pytest.raises(MTNLGError, match=r"^layer_types lists 2 layer kinds for a 3-layer model$"):
        ModelConfig(**base, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    with pytest.raises(
        MTNLGError, match=r"^layer_types has 'local', not one of full_attention, sliding_attention, linear_attention$"
    ):
        ModelConfig(**base, layer_types=["local"] * 3, sliding_window=8)
    with pytest.raises(MTNLGError, match=r"^sliding_attention layers need sliding_window >= 1"):
        ModelConfig(**base, layer_types=["sliding_attention"] * 3)
    with pytest.raises(MTNLGError, match=r"^sliding_window 64 is not smaller than seq_len 64: no query would lose"):
        ModelConfig(**base, layer_types=["sliding_attention"] * 3, sliding_window=64)


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("packed", [False, True])
def test_the_context_parallel_ring_honours_a_sliding_window_exactly(packed, sinks):
    """cp 2 and 3 ranks on threads (test_document_mask's ring): a window of 5 keys, one sequence or packed
    documents, with and without a sink per head; the output and the gradients of q, k, v (and of the sinks, each
    rank's part summed) equal the whole sequence's dense windowed attention."""
    from test_document_mask import QueueRing

    from mtnlg_lightning.model import CausalMasks, DocumentMask
    from mtnlg_lightning.parallel.context_parallel import RingAttentionCore, split_sequence

    generator = torch.Generator().manual_seed(0)
    B, S, D, window = 2, 36, 8, 5
    q, grad = torch.randn(B, 4, S, D, generator=generator), torch.randn(B, 4, S, D, generator=generator)
    k, v = torch.randn(B, 2, S, D, generator=generator), torch.randn(B, 2, S, D, generator=generator)
    document_ids = torch.tensor([[0] * 7 + [1] * 20 + [2] * 9, [0] * 36]) if packed else torch.zeros(1, S).long()
    sink = torch.randn(4, generator=generator) * 2 if sinks else None
    whole = [t.clone().requires_grad_() for t in (q, k, v, *([sink] if sinks else []))]
    out = DocumentMask(document_ids, "sdpa", window).attend(*whole[:3], 0.0, *whole[3:])
    (out * grad).sum().backward()
    expected = [out.detach(), *(t.grad for t in whole)]
    for cp in (2, 3):
        inboxes, results = [queue.Queue() for _ in range(cp)], [None] * cp

        def rank(r: int, cp=cp, inboxes=inboxes, results=results) -> None:
            mine = [split_sequence(t, r, cp, dim=2).clone().requires_grad_() for t in (q, k, v)]
            mine += [sink.clone().requires_grad_()] if sinks else []
            masks = DocumentMask(document_ids, "blocks") if packed else CausalMasks("blocks")
            mask = masks.for_window(window, mine[0].shape[2], q.device)
            y = RingAttentionCore(QueueRing(inboxes, r))(*mine[:3], 0.0, mask, *mine[3:])
            (y * split_sequence(grad, r, cp, dim=2)).sum().backward()
            results[r] = [y.detach(), *(t.grad for t in mine)]

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for r, got in enumerate(results):
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=False):
                torch.testing.assert_close(a, split_sequence(b, r, cp, dim=2), rtol=0, atol=1e-5, msg=f"{name} {r}")
        if sinks:  # a parameter: each rank's gradient is its queries' part (the data-parallel x CP sum adds them)
            torch.testing.assert_close(sum(got[4] for got in results), expected[4], rtol=0, atol=1e-5)


# The published text models' config.json values (gemma-3-27b-pt's text_config; gpt-oss-20b / -120b).
GPT_OSS_PUBLISHED = dict(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, num_experts_per_tok=4, sliding_window=128,
)  # fmt: skip
PUBLISHED = {
    "gemma-3-27b": (
        "Gemma3TextConfig",
        dict(
            vocab_size=262208,
            hidden_size=5376,
            intermediate_size=21504,
            num_hidden_layers=62,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=128,
            query_pre_attn_scalar=168,
            sliding_window=1024,
        ),  # fmt: skip
    ),
    "gpt-oss-20b": ("GptOssConfig", dict(GPT_OSS_PUBLISHED, num_hidden_layers=24, num_local_experts=32)),
    "gpt-oss-120b": ("GptOssConfig", dict(GPT_OSS_PUBLISHED, num_hidden_layers=36, num_local_experts=128)),
    "qwen3-next-80b-a3b": (
        "Qwen3NextConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5120,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
        ),  # fmt: skip
    ),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_the_presets_count_what_transformers_builds(preset):
    """Our count (measured on the meta device) equals transformers' model of the published config, built on the
    meta device (27,009,346,304 / 20,914,757,184 / 116,829,156,672 / 79,674,391,296); the preset's layer pattern
    is theirs."""
    from mtnlg_lightning.config import get_config
    from mtnlg_lightning.families import count_parameters

    config_class, values = PUBLISHED[preset]
    hf_config = getattr(transformers, config_class)(**values)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(hf_config)
    ours = get_config(preset)
    assert count_parameters(ours) == sum(p.numel() for p in theirs.parameters())
    assert ours.layer_types == hf_config.layer_types
    assert ours.sliding_window == getattr(hf_config, "sliding_window", None)


def test_a_qwen3_with_yarn_rope_scaling_gives_transformers_logits(tmp_path):
    """YaRN read from a Qwen / Llama-style config (rope_parameters.rope_type yarn, as Qwen's long-context
    configs say), on rows past the original context so every band of frequencies is exercised."""
    from hf_models import random_family_dir

    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32, "rope_theta": 1_000_000.0}
    source = random_family_dir(tmp_path, "qwen3", rope_parameters=yarn)
    tokens = torch.randint(0, 4096, (2, 100), generator=torch.Generator().manual_seed(0))
    ours, _ = load_model(source)
    assert ours.config.rope_scaling["rope_type"] == "yarn"
    with torch.no_grad():
        assert (ours(tokens)[..., :4096] - hf_model(source)(tokens).logits).abs().max().item() < 1e-5


def test_a_sliding_layer_s_cache_stops_growing_at_the_window(family_dir):
    """A prefill of 12 then one position at a time to 40: every step's logits are the full forward's, the sliding
    layers hold 8 positions (the window), the full layers all 40, and a Gated DeltaNet layer its convolution's
    inputs and its state, the same size after 12 positions and after 40."""
    from mtnlg_lightning.model import KVCache

    model, _ = load_model(family_dir)
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(2))
    cache = KVCache(40)
    with torch.no_grad():
        reference = model(tokens)
        steps = [model(tokens[:, :12], cache)[:, 0]]
        state_shapes = {name: {k: t.shape for k, t in held.items()} for name, held in cache.states.items()}
        for t in range(12, 40):
            cache.start = t
            steps.append(model(tokens[:, t : t + 1], cache)[:, 0])
    got = torch.stack(steps, dim=1)
    assert (got - reference[:, 11:]).abs().max().item() < 1e-4
    window, types = model.config.sliding_window, model.config.layer_types
    held = {int(name): keys.shape[2] for name, keys in cache.keys.items()}
    kinds = {i: kind for i, kind in enumerate(types) if kind != "linear_attention"}
    assert held == {i: window if kind == "sliding_attention" else 40 for i, kind in kinds.items()}
    assert sorted(map(int, cache.states)) == [i for i, kind in enumerate(types) if kind == "linear_attention"]
    assert state_shapes == {name: {k: t.shape for k, t in held.items()} for name, held in cache.states.items()}
    full, sliding = types.count("full_attention"), types.count("sliding_attention")
    per_layer_position = cache.bytes_per_position() // full  # of one row: the full layers grow, the others do not
    states = sum(t.numel() * t.element_size() for held in cache.states.values() for t in held.values())
    assert cache.bytes_held() == 2 * per_layer_position * (full * 40 + sliding * (window or 0)) + states


def test_mxfp4_experts_are_dequantised_on_import_as_transformers_does(tmp_path):
    """A GPT-OSS directory whose experts are MXFP4 blocks and scales (random codes, exponents near 2^-7): our import
    holds exactly what transformers' `convert_moe_packed_tensors` makes of them, and our logits are transformers'
    on the directory written with those dequantised weights."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from mtnlg_lightning.interop.hf import read_hf_dir

    source = random_attention_kind_dir(tmp_path, "gpt_oss")
    tensors, generator = load_file(source / "model.safetensors"), torch.Generator().manual_seed(3)
    quantised, dequantised = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, inputs, outputs = tensors[name].shape
        blocks = torch.randint(0, 256, (e, outputs, inputs // 32, 16), generator=generator, dtype=torch.uint8)
        scales = torch.randint(118, 123, (e, outputs, inputs // 32), generator=generator, dtype=torch.uint8)
        del quantised[name]
        quantised |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
        dequantised[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    packed, reference = tmp_path / "mxfp4", tmp_path / "dequantised"
    for directory, weights in ((packed, quantised), (reference, dequantised)):
        directory.mkdir()
        config = json.loads((source / "config.json").read_text())
        if directory == packed:
            config["quantization_config"] = {
                "quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn"],
            }
        (directory / "config.json").write_text(json.dumps(config))
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    ours, theirs = read_hf_dir(packed).weights, read_hf_dir(reference).weights
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(4))
    model, _ = load_model(packed)
    with torch.no_grad():
        assert (model(tokens)[..., :4096] - hf_model(reference)(tokens).logits).abs().max().item() < 1e-5


def test_layouts_not_built_for_gated_deltanet_are_one_line(tmp_path):
    """Context parallelism with sequence parallelism for Gated DeltaNet layers, and a tensor parallelism that does
    not divide the key heads: refused before anything is sharded. (Without sequence parallelism each Gated DeltaNet
    layer passes its state between the CP ranks' chunks, except while decoding's whole sequences run.)"""
    from types import SimpleNamespace

    from mtnlg_lightning.linear_attention import GatedDeltaNet
    from mtnlg_lightning.parallel.context_parallel import (
        ContextStatePassing,
        apply_context_parallel,
        whole_sequences,
    )
    from mtnlg_lightning.parallel.tensor_parallel import apply_tensor_parallel

    model, _ = load_model(random_attention_kind_dir(tmp_path, "qwen3_next"))
    with pytest.raises(MTNLGError, match="^tensor_parallel 4 does not divide Gated DeltaNet's 2 key heads"):
        apply_tensor_parallel(model, None, 0, 4)
    for layer in (m for m in model.modules() if isinstance(m, GatedDeltaNet)):
        layer.split_heads(1, sequence_parallel=True)  # as tensor parallelism with sequence parallelism leaves it
    ring = SimpleNamespace(size=2, group=None, cp_rank=0)
    with pytest.raises(MTNLGError, match="^context_parallel with sequence parallelism cannot run Gated DeltaNet"):
        apply_context_parallel(model, ring)
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    for layer in layers:
        layer.sequence_parallel = False
    apply_context_parallel(model, ring)  # each Gated DeltaNet layer passes its state; decoding's whole sequences not
    with whole_sequences([model]):
        assert all(layer.context is None for layer in layers)
    assert all(isinstance(layer.context, ContextStatePassing) for layer in layers)


@pytest.mark.parametrize("cp", [2, 3])
def test_a_gated_deltanet_layer_under_context_parallelism_is_the_whole_sequence_s(tmp_path, cp):
    """The other path, gathering the whole sequence (`ContextGather`, `apply_context_parallel(..., linear="gather")`).
    Threads as CP ranks, each holding its two load-balanced chunks of packed rows of 72 tokens (documents
    crossing the chunks, two of the delta rule's chunks of 64): each rank's output is its chunks of the whole
    sequence's, its input gradient its chunks' of the whole one, and the parameter gradients summed over the ranks
    the whole sequence's."""
    import copy

    import torch.distributed as dist
    from threaded_group import run_ranks

    from mtnlg_lightning.model import DocumentMask
    from mtnlg_lightning.parallel.context_parallel import ContextGather, split_sequence

    layer = load_model(random_attention_kind_dir(tmp_path, "qwen3_next"))[0].blocks["0"].attn.double()
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 72, 64, dtype=torch.float64, generator=generator)
    grad = torch.randn(2, 72, 64, dtype=torch.float64, generator=generator)
    mask = DocumentMask(torch.tensor([[0] * 11 + [1] * 40 + [2] * 21, [0] * 72]), "blocks")
    whole = x.clone().requires_grad_()
    out = layer(whole, mask=mask)
    (out * grad).sum().backward()
    expected = {name: p.grad for name, p in layer.named_parameters()}

    def rank_fn(rank: int):
        mine = copy.deepcopy(layer)
        mine.zero_grad()
        mine.context = ContextGather(dist.group.WORLD, rank, cp)
        chunks = split_sequence(x, rank, cp).requires_grad_()
        y = mine(chunks, mask=mask)
        (y * split_sequence(grad, rank, cp)).sum().backward()
        return y.detach(), chunks.grad, {name: p.grad for name, p in mine.named_parameters()}

    results = run_ranks(cp, rank_fn)
    for rank, (y, x_grad, _) in enumerate(results):
        torch.testing.assert_close(y, split_sequence(out.detach(), rank, cp), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(x_grad, split_sequence(whole.grad, rank, cp), rtol=1e-6, atol=1e-7)
    for name, param_grad in expected.items():
        summed = sum(grads[name] for _, _, grads in results)  # each rank's part, the delta rule's fp32 rounding
        scale = param_grad.abs().max().item()
        torch.testing.assert_close(summed, param_grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name: n + m)


# Packed rows for the state passing: at 96 tokens cp2's chunks start at 24, 48, 72 and cp3's at 16, 32, 48, 64, 80.
# Row 0: documents of 5 and 2 tokens (shorter than the convolution's kernel of 4), one to 48 over chunk starts, one
# from 48 (a chunk's start) through a whole chunk into the next (so that chunk's state map must not see its incoming
# state), one of 3 from 80 (cp3's chunk start), one to the end. Row 1: one from 47 (the next chunk's window holds
# one of its inputs) over two chunk starts, one from 80.
STATE_PASSING_IDS = torch.tensor(
    [[0] * 5 + [1] * 2 + [2] * 41 + [3] * 32 + [4] * 3 + [5] * 13, [0] * 20 + [1] * 27 + [2] * 33 + [3] * 16]
)


@pytest.mark.parametrize(
    "cp,length,packed",
    [(2, 96, True), (3, 96, True), (2, 160, False), (3, 12, False)],
    ids=["cp2_packed", "cp3_packed", "cp2_chunks_longer_than_the_rule_s", "cp3_chunks_shorter_than_the_kernel"],
)
def test_a_gated_deltanet_layer_passes_its_state_between_the_context_parallel_ranks_exactly(
    gated_deltanet_layer, cp, length, packed
):
    """Threads as CP ranks, each running the layer over its two load-balanced chunks only (`ContextStatePassing`):
    the convolution's inputs before each chunk and each chunk's affine state map all-gathered, the incoming states
    composed in sequence order. Packed rows (documents starting inside chunks and at their starts, shorter than the
    kernel, over several chunk boundaries), one sequence in chunks longer than the rule's chunk of 64, and chunks of
    2 tokens (a window of 3 inputs spans two chunks): each rank's output and input gradient are its chunks' of the
    whole sequence's, and the parameter gradients summed over the ranks the whole sequence's, within 1e-11 of each
    tensor's scale. In float64 (the rule computes in it for a float64 layer): in fp32 the decay's gradients (dt_bias,
    A_log: sums over every position that nearly cancel) move 1.3e-5 of their scale when only the rule's inner chunk
    changes from 64 to 32, which would hide a small error."""
    import copy

    import torch.distributed as dist
    from threaded_group import run_ranks

    from mtnlg_lightning.model import DocumentMask
    from mtnlg_lightning.parallel.context_parallel import ContextStatePassing, split_sequence

    layer = gated_deltanet_layer
    generator = torch.Generator().manual_seed(5)
    x, grad = (torch.randn(2, length, 64, generator=generator, dtype=torch.float64) for _ in range(2))
    mask = DocumentMask(STATE_PASSING_IDS, "blocks") if packed else None
    whole = x.clone().requires_grad_()
    reference = copy.deepcopy(layer)
    out = reference(whole, mask=mask)
    (out * grad).sum().backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}

    def rank_fn(rank: int):
        mine = copy.deepcopy(layer)
        mine.context = ContextStatePassing(dist.group.WORLD, rank, cp)
        chunks = split_sequence(x, rank, cp).requires_grad_()
        y = mine(chunks, mask=mask)
        (y * split_sequence(grad, rank, cp)).sum().backward()
        return y.detach(), chunks.grad, {name: p.grad for name, p in mine.named_parameters()}

    def close(got, want, what):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11 * scale, msg=lambda m: f"{what}: {m}")

    results = run_ranks(cp, rank_fn)
    for rank, (y, x_grad, _) in enumerate(results):
        close(y, split_sequence(out.detach(), rank, cp), f"output of rank {rank}")
        close(x_grad, split_sequence(whole.grad, rank, cp), f"input gradient of rank {rank}")
    assert expected.keys() == results[0][2].keys()
    for name, param_grad in expected.items():
        close(sum(grads[name] for _, _, grads in results), param_grad, name)


@pytest.fixture(scope="module")
def gated_deltanet_layer(tmp_path_factory):
    """The first Gated DeltaNet layer of a random Qwen3-Next (2 key heads, 4 value heads, d_k 8, d_v 16, kernel 4),
    in float64, its decays slow (rates A in [0.01, 0.1], not the init's [1, 16]): with the init's a state fades by
    e^-30 over a chunk of 24 tokens, and a mistake in passing it would hide."""
    model = load_model(random_attention_kind_dir(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next"))[0]
    layer = model.blocks["0"].attn.double()
    with torch.no_grad():
        layer.decay.A_log.copy_(torch.linspace(0.01, 0.1, layer.nv, dtype=torch.float64).log())
    return layer


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_tensor_parallel_splits_gated_deltanet_by_key_heads_to_one_process_s_gradients(tmp_path, sequence_parallel):
    """Threads as ranks: a random Qwen3-Next (2 key heads, 4 value heads) over 2 ranks, one key head and its value
    heads each (projections column and row, the convolution's grouped channels and the decay per value head
    sharded, the gated norm replicated with its gradient summed), on packed rows of 70 tokens (two chunks of 64,
    documents restarting the state): the loss and every gradient, gathered, are one process's."""
    from threaded_group import tensor_parallel_runs

    from mtnlg_lightning.parallel.tensor_parallel import vocab_parallel_cross_entropy

    reference = load_model(random_attention_kind_dir(tmp_path, "qwen3_next"))[0].double()
    tokens = torch.randint(0, 4096, (2, 71), generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[0] * 30 + [1] * 40, [0] * 70])
    logits = reference(tokens[:, :-1], document_ids=ids)
    loss = vocab_parallel_cross_entropy(logits, tokens[:, 1:], None)  # its softmax in fp32, as the ranks' is
    loss.backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for rank_loss, grads in tensor_parallel_runs(reference, tokens, sequence_parallel, document_ids=ids):
        assert rank_loss.item() == pytest.approx(loss.item(), rel=1e-6)
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            # the loss's softmax and the delta rule run in fp32 whatever the model's dtype: their rounding, at the
            # size of each tensor (a head paired with another's channels is off by its whole size)
            scale = expected[name].abs().max().item()
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-4 * scale, msg=lambda m, n=name: n + m)


@pytest.mark.parametrize(
    "preset,length,saved",
    [
        ("gpt-oss-120b", 32768, 0.498),
        ("gpt-oss-120b", 131072, 0.500),
        ("gemma-3-27b", 32768, 0.812),
        ("gemma-3-27b", 131072, 0.832),
        ("qwen3-next-80b-a3b", 32768, 0.726),
        ("qwen3-next-80b-a3b", 131072, 0.744),
    ],
)
def test_the_planner_counts_a_sliding_layer_s_window_and_a_gated_deltanet_state(preset, length, saved):
    """The decode cache the planners count (`planning/activations.kv_cache_bytes`, bf16, one row): a sliding
    layer's window, a Gated DeltaNet layer's fixed state; what that saves against every layer caching every
    position, at 32k and 128k tokens."""
    import dataclasses

    from mtnlg_lightning.config import get_config
    from mtnlg_lightning.planning.activations import kv_cache_bytes

    config = get_config(preset)
    all_full = dataclasses.replace(config, layer_types=None, sliding_rope_theta=None)
    ours, full = (kv_cache_bytes(c, c.num_layers, 1, length, 1) for c in (config, all_full))
    assert 1 - ours / full == pytest.approx(saved, abs=5e-4)
    if preset == "gpt-oss-120b":  # 18 full layers of every position, 18 of 128; 8 KV heads x 64 dims x 2 x 2 bytes
        assert ours == (18 * length + 18 * 128) * 2048


def test_lora_adapts_gemma3_s_projections_and_merges_to_its_logits(tmp_path):
    """LoRA on Gemma 3 (its tanh-GELU MLP has Llama's gate / up / down): 7 adapters a block, merged weights give the
    adapted model's logits; GPT-OSS (experts in every block) adapts its attention."""
    import copy

    from mtnlg_lightning.parallel.lora import LoRAConfig, LoRALinear, apply_lora, merge_lora

    model, _ = load_model(random_attention_kind_dir(tmp_path, "gemma3_text"))
    model = model.double()
    assert apply_lora(model, LoRAConfig(rank=4)) == 6 * 7
    for adapter in (m for m in model.modules() if isinstance(m, LoRALinear)):
        torch.nn.init.normal_(adapter.lora_b, std=0.01)
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(merge_lora(copy.deepcopy(model))(tokens), model(tokens), rtol=1e-10, atol=1e-10)
    experts_only, _ = load_model(random_attention_kind_dir(tmp_path, "gpt_oss"))  # GPT-OSS: attention adapters
    assert apply_lora(experts_only, LoRAConfig(rank=4)) == 4 * 4


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_lora_adapts_gated_deltanet_s_projections_in_tp2_and_loads_in_peft_with_our_logits(tmp_path, sequence_parallel):
    """LoRA on a random Qwen3-Next (3 Gated DeltaNet layers, 1 full; experts in every block): in_proj_qkvz, in_proj_ba
    and out_proj in the Gated DeltaNet layers (Hugging Face's names target them too), q, k, v, o in the full one,
    the convolution frozen; the planner counts them; the adapters' loss and gradients in tp2 are one process's,
    merged weights give the adapted logits, and the PEFT export loads in peft on transformers' model with our
    logits."""
    import copy

    from test_lora import _adapter_state, _peft_logits
    from threaded_group import tensor_parallel_runs

    from mtnlg_lightning.interop.peft_adapter import write_peft_adapter
    from mtnlg_lightning.parallel.lora import LoRAConfig, LoRALinear, apply_lora, merge_lora
    from mtnlg_lightning.parallel.tensor_parallel import vocab_parallel_cross_entropy
    from mtnlg_lightning.planning.lora_plan import adapter_params_per_block

    base_dir = random_attention_kind_dir(tmp_path, "qwen3_next")
    model = load_model(base_dir)[0].double()
    settings = {"rank": 4, "alpha": 8}
    assert LoRAConfig(targets=("in_proj_qkvz", "out_proj")).projections(model.config) == ("in_proj_qkvz", "out_proj")
    assert apply_lora(model, LoRAConfig.from_dict(settings)) == 3 * 3 + 4
    adapted = {name.rsplit(".", 1)[0] for name, p in model.named_parameters() if p.requires_grad}
    assert "blocks.0.attn.in_proj_ba" in adapted and "blocks.3.attn.q" in adapted
    assert not any("conv1d" in name for name in adapted)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # the planner's mean over the layers
    assert adapter_params_per_block(model.config, 1, LoRAConfig.from_dict(settings)) == round(trained / 4)
    for adapter in (m for m in model.modules() if isinstance(m, LoRALinear)):
        torch.nn.init.normal_(adapter.lora_b, std=0.05)
    tokens = torch.randint(0, 4096, (2, 71), generator=torch.Generator().manual_seed(3))
    loss = vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], None)
    loss.backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    for rank_loss, grads in tensor_parallel_runs(model, tokens, sequence_parallel):
        assert rank_loss.item() == pytest.approx(loss.item(), rel=1e-6)
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():  # fp32 in the delta rule and the loss, as above
            scale = expected[name].abs().max().item()
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-4 * scale, msg=lambda m, n=name: n + m)
    model.zero_grad()
    with torch.no_grad():
        ours = model(tokens)
        torch.testing.assert_close(merge_lora(copy.deepcopy(model))(tokens), ours, rtol=1e-10, atol=1e-10)
    if sequence_parallel:
        return  # the export does not depend on the layout: once
    model.float()  # as transformers' model in peft computes
    write_peft_adapter(_adapter_state(model, settings, base_dir), tmp_path / "adapter")
    theirs, _ = _peft_logits(base_dir, tmp_path / "adapter", tokens)
    with torch.no_grad():
        torch.testing.assert_close(theirs, model(tokens)[..., : theirs.shape[-1]], rtol=1e-5, atol=1e-5)


def test_a_gated_deltanet_decode_state_is_the_same_size_at_256_and_2048_tokens():
    """A custom two-layer block (one Gated DeltaNet layer, one full): after a prefill of 256 and of 2048 tokens the
    Gated DeltaNet layer holds the same bytes; the full layer's keys and values grow 8-fold."""
    from mtnlg_lightning.model import KVCache, build_model

    config = ModelConfig(
        num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, seq_len=2048, vocab_size=256, family=None,
        position_embedding="rope", norm="rmsnorm", mlp="swiglu", layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    )  # fmt: skip
    model = build_model(config).eval()
    held = {}
    for length in (256, 2048):
        cache = KVCache(length)
        with torch.no_grad():
            model(torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(6)), cache)
        states = sum(t.numel() * t.element_size() for t in cache.states["0"].values())
        held[length] = (states, cache.keys["1"].numel() * cache.keys["1"].element_size())
    assert held[256][0] == held[2048][0] == 3 * (2 * 8 + 16) * 4 + 2 * 8 * 8 * 4  # conv inputs + fp32 state
    assert held[2048][1] == 8 * held[256][1]
