"""LoRA: the adapter starts as its base, merges into it exactly, shards under tensor (and sequence) parallelism to
the single-process numbers, trains only itself, and leaves as a PEFT directory that peft loads to our logits."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from threaded_group import run_ranks

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.model import build_model
from mtnlg_lightning.parallel.lora import (
    LoRAConfig,
    LoRALinear,
    apply_lora,
    lora_config,
    merge_lora,
    shard_with_adapters,
)
from mtnlg_lightning.parallel.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy
from mtnlg_lightning.train.optimizer_recipe import build_adamw

GPT_TINY = get_config("tiny")  # fused qkv [heads, 3, head_dim], GELU fc1/fc2, biases
LLAMA_TINY = get_config("demo-llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=96)


def adapted_model(config, lora: dict, seed: int = 0, random_b: bool = True) -> torch.nn.Module:
    """A float64 model with adapters; `random_b`: B drawn too (a fresh adapter's B is zero, which hides errors)."""
    torch.manual_seed(seed)
    model = build_model(config).double()
    apply_lora(model, LoRAConfig.from_dict(lora))
    if random_b:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, LoRALinear):
                    module.lora_b.normal_(0.0, 0.05)
    return model


def tokens_for(config, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ configuration
def test_targets_take_our_names_or_hugging_faces_and_default_to_every_projection():
    everything = LoRAConfig()
    assert everything.projections(LLAMA_TINY) == ("q", "k", "v", "proj", "gate", "up", "down")
    assert everything.projections(GPT_TINY) == ("qkv", "proj", "fc1", "fc2")
    hf = LoRAConfig.from_dict({"targets": ["q_proj", "v_proj", "down_proj"]})
    assert hf.projections(LLAMA_TINY) == ("q", "v", "down")
    assert LoRAConfig.from_dict({"targets": ["qkv", "fc2"]}).projections(GPT_TINY) == ("qkv", "fc2")
    assert LoRAConfig.from_dict({"targets": ["c_attn", "c_proj"]}).projections(GPT_TINY) == ("qkv", "proj", "fc2")
    fused = LoRAConfig.from_dict({"targets": ["q", "k", "v"]})
    assert fused.projections(GPT_TINY) == ("qkv",)
    fused_llama = dataclasses.replace(LLAMA_TINY, num_kv_heads=LLAMA_TINY.num_heads)  # one fused q/k/v here
    assert LoRAConfig.from_dict({"targets": ["q_proj", "k_proj", "v_proj"]}).projections(fused_llama) == ("qkv",)
    # Hugging Face's names are those of the family the config names: Llama's are not GPT-2's
    with pytest.raises(MTNLGError, match="targets 'q_proj', which this model does not have"):
        LoRAConfig.from_dict({"targets": ["q_proj"]}).projections(GPT_TINY)


@pytest.mark.parametrize(
    ("values", "config", "message"),
    [
        ({"rank": 0}, LLAMA_TINY, "rank must be an integer > 0"),
        ({"rank": -4}, LLAMA_TINY, "rank must be an integer > 0"),
        ({"alpha": 0}, LLAMA_TINY, "alpha must be a number > 0"),
        ({"dropout": 1.0}, LLAMA_TINY, "dropout must be in [0, 1)"),
        ({"ranks": 8}, LLAMA_TINY, "unknown field(s) ['ranks']"),
        ({"targets": ["gate_proj"]}, GPT_TINY, "targets 'gate_proj', which this model does not have"),
        ({"targets": ["fc1"]}, LLAMA_TINY, "targets 'fc1', which this model does not have"),
        ({"targets": ["lm_head"]}, LLAMA_TINY, "targets 'lm_head', which this model does not have"),
        ({"targets": ["q", "v"]}, GPT_TINY, "target q, k and v together"),
    ],
)
def test_bad_lora_settings_are_one_line(values, config, message):
    with pytest.raises(MTNLGError) as error:
        lora_config(values).projections(config)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_scale_is_alpha_over_rank_or_over_its_root_with_rslora():
    assert LoRAConfig.from_dict({"rank": 16, "alpha": 32}).scale == 2.0
    assert LoRAConfig.from_dict({"rank": 16, "alpha": 32, "rslora": True}).scale == 8.0


# ------------------------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("config", [GPT_TINY, LLAMA_TINY], ids=["gpt", "llama"])
def test_a_fresh_adapter_is_the_base_model(config):
    torch.manual_seed(0)
    base = build_model(config).double()
    adapted = copy.deepcopy(base)
    assert apply_lora(adapted, LoRAConfig(rank=4)) == config.num_layers * len(LoRAConfig().projections(config))
    tokens = tokens_for(config)
    torch.testing.assert_close(adapted(tokens), base(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("rslora", [False, True])
@pytest.mark.parametrize("config", [GPT_TINY, LLAMA_TINY], ids=["gpt", "llama"])
def test_merged_weights_give_the_adapters_logits(config, rslora):
    adapted = adapted_model(config, {"rank": 4, "alpha": 8, "rslora": rslora})
    tokens = tokens_for(config)
    with torch.no_grad():
        expected = adapted(tokens)
        merged = merge_lora(copy.deepcopy(adapted))
        assert not any(isinstance(m, LoRALinear) for m in merged.modules())
        torch.testing.assert_close(merged(tokens), expected, rtol=1e-10, atol=1e-10)
    # and the update is W + s B A, s = alpha / r or alpha / sqrt(r)
    adapter = adapted.blocks["0"].attn.proj
    scale = 8 / (2 if rslora else 4)
    delta = merged.blocks["0"].attn.proj.weight - adapter.base.weight
    torch.testing.assert_close(delta, scale * adapter.lora_b @ adapter.lora_a)


def test_the_base_is_frozen_and_the_optimizer_holds_state_for_the_adapter_only():
    """Plain AdamW (fp32): exp_avg and exp_avg_sq, 8 bytes per adapter parameter and none for the base. (Under
    ZeRO with bf16 the fp32 master adds 4: 12 bytes, measured by the ZeRO-1 test below.)"""
    torch.manual_seed(0)
    model = build_model(LLAMA_TINY)
    total = sum(p.numel() for p in model.parameters())
    apply_lora(model, LoRAConfig(rank=4))
    trainable = [p for p in model.parameters() if p.requires_grad]
    adapter = sum(p.numel() for p in trainable)
    assert all(name.endswith(("lora_a", "lora_b")) for name, p in model.named_parameters() if p.requires_grad)
    assert 0 < adapter < total / 10
    optimizer = build_adamw(model, 1e-3, 0.1, (0.9, 0.95), 1e-8, None)
    tokens = tokens_for(LLAMA_TINY)
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    optimizer.step()
    state_bytes = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items() if k != "step"
    )
    full_finetuning = 8 * total  # what AdamW would hold for every parameter
    print(f"\nAdamW state: {state_bytes:,} bytes for {adapter:,} adapter parameters; {full_finetuning:,} for all")
    assert state_bytes == 8 * adapter


# ------------------------------------------------------------------------------------------------ tensor parallel
def _gather(param: torch.Tensor, tensor: torch.Tensor, group) -> torch.Tensor:
    """The model-space tensor of a TP shard (ranks sharing a copy of a shard counted once)."""
    if not hasattr(param, "partition_dim"):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    copies = len(parts) // param.partition_count
    return torch.cat(parts[::copies], dim=param.partition_dim)


@pytest.mark.parametrize(
    ("config", "tp", "sequence_parallel"),
    [
        (GPT_TINY, 2, False),
        (GPT_TINY, 2, True),
        (LLAMA_TINY, 2, False),
        (LLAMA_TINY, 2, True),
        (LLAMA_TINY, 4, False),  # TP above the 2 key/value heads: k and v (and their B) shared by two ranks
    ],
    ids=["gpt-tp2", "gpt-tp2-sp", "llama-tp2", "llama-tp2-sp", "llama-tp4-kv-copies"],
)
def test_tensor_parallel_adapters_give_the_single_process_loss_and_adapter_gradients(config, tp, sequence_parallel):
    reference = adapted_model(config, {"rank": 4, "alpha": 8})
    tokens = tokens_for(config)
    loss = F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}

    def rank_fn(rank):
        group = dist.group.WORLD
        model = copy.deepcopy(reference)
        model.zero_grad()
        kv_group = None
        if not config.fused_qkv and tp > config.num_kv_heads:  # the ranks sharing this rank's key/value head
            copies = tp // config.num_kv_heads
            pairs = [dist.new_group(list(range(s, s + copies))) for s in range(0, tp, copies)]
            kv_group = pairs[rank // copies]

        def shard():
            apply_tensor_parallel(model, group, rank, tp, sequence_parallel, kv_group)

        shard_with_adapters(model, shard, rank, tp, kv_group)
        rank_loss = vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], group)
        rank_loss.backward()
        grads = {n: _gather(p, p.grad, group) for n, p in model.named_parameters() if p.requires_grad}
        frozen_grads = [p.grad for p in model.parameters() if not p.requires_grad]
        return rank_loss.detach(), grads, frozen_grads

    for rank_loss, grads, frozen_grads in run_ranks(tp, rank_fn):
        assert rank_loss.item() == pytest.approx(loss.item(), rel=1e-6)  # the vocab-parallel loss runs in fp32
        assert grads.keys() == expected.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
        assert all(g is None for g in frozen_grads)


# ------------------------------------------------------------------------------------------------ PEFT adapters
def _our_model(source_dir) -> torch.nn.Module:
    from mtnlg_lightning.checkpoint.model_state import load_model_space
    from mtnlg_lightning.interop.hf import read_source

    source = read_source(source_dir)
    model = build_model(source.config)
    load_model_space(model, source.weights)
    return model.eval()


def _adapter_state(model, lora: dict, base_dir):
    """A LoRA checkpoint's `ModelState` (adapters only, the base named) of an in-memory adapted model."""
    from mtnlg_lightning.checkpoint import ModelState
    from mtnlg_lightning.interop.lora_base import base_reference

    weights = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(("lora_a", "lora_b"))}
    return ModelState(model.config, weights, {}, None, lora, base_reference(base_dir))


def _peft_logits(base_dir, adapter_dir, tokens):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
        return adapted(tokens).logits, adapted


@pytest.mark.parametrize(
    ("family", "lora"),
    [
        ("gpt2", {"rank": 4, "alpha": 8}),  # c_attn fused on both sides, Conv1D (fan_in_fan_out)
        ("gpt2", {"rank": 4, "alpha": 8, "targets": ["c_attn", "fc2"]}),  # one of GPT-2's two c_proj
        ("llama-mha", {"rank": 4, "alpha": 8, "rslora": True}),  # our fused qkv -> q_proj, k_proj, v_proj
    ],
    ids=["gpt2-all", "gpt2-c_attn-mlp.c_proj", "llama-fused-qkv-rslora"],
)
def test_a_peft_adapter_loads_in_peft_with_our_logits(family, lora, tmp_path):
    from hf_models import random_family_dir, random_gpt2_dir

    from mtnlg_lightning.interop.peft_adapter import write_peft_adapter

    if family == "gpt2":
        base_dir = random_gpt2_dir(tmp_path)
    else:
        base_dir = random_family_dir(tmp_path, "llama", num_key_value_heads=4)
    model = _our_model(base_dir)
    assert model.config.fused_qkv
    apply_lora(model, LoRAConfig.from_dict(lora))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.normal_(0.0, 0.05)
    write_peft_adapter(_adapter_state(model, lora, base_dir), tmp_path / "adapter")
    tokens = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)
    theirs, _ = _peft_logits(base_dir, tmp_path / "adapter", tokens)
    torch.testing.assert_close(theirs, ours[..., : theirs.shape[-1]], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ a LoRA run
LORA_RUN = {"rank": 4, "alpha": 8}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """5 LoRA steps from a Hugging Face Llama directory (grouped-query: separate q, k, v) in one process, a
    checkpoint after every step."""
    from hf_models import random_family_dir

    from testing.parallel_harness import tiny_run

    root = tmp_path_factory.mktemp("lora_run")
    base_dir = random_family_dir(root, "llama")
    rec, trainer = tiny_run(init_from=str(base_dir), lora=LORA_RUN, checkpoint_dir=root / "ckpt", checkpoint_every=1)
    model = trainer.lightning_module.model.eval()
    found = {"losses": rec.losses, "grad_norms": rec.grad_norms, "params": rec.params}
    return {"root": root, "base": base_dir, "ckpt": root / "ckpt", "model": model, **found}


def test_a_lora_run_checkpoints_the_adapter_and_names_its_base(lora_run):
    import json

    from mtnlg_lightning.checkpoint import read_model_state
    from mtnlg_lightning.interop.lora_base import content_hash

    manifest = json.loads((lora_run["ckpt"] / "step=5.ckpt" / "manifest.json").read_text())
    weights = [k for k in manifest["tensors"] if k.startswith("model/")]
    assert weights and all(k.endswith((".lora_a", ".lora_b")) for k in weights)
    assert manifest["lora"]["rank"] == 4
    state = read_model_state(lora_run["ckpt"] / "step=5.ckpt")
    assert state.base == {"path": str(lora_run["base"].resolve()), "content": content_hash(lora_run["base"])}
    stored = sum(e["size"] for name, e in manifest["files"].items() if name.endswith(".safetensors"))
    base = sum(f.stat().st_size for f in lora_run["base"].glob("*.safetensors"))
    print(f"\nLoRA checkpoint {stored:,} bytes (adapters and their Adam moments); the base's weights {base:,}")
    assert stored < base / 10
    trained_b = [m.lora_b for m in lora_run["model"].modules() if isinstance(m, LoRALinear)]
    assert all(b.abs().max() > 0 for b in trained_b)  # the adapters trained (B starts at zero)


def test_a_lora_checkpoint_reads_as_its_base_with_the_adapters_merged(lora_run):
    from mtnlg_lightning.checkpoint.model_state import load_model_space
    from mtnlg_lightning.interop.hf import read_source

    merged = read_source(lora_run["ckpt"] / "step=5.ckpt")
    model = build_model(merged.config)
    load_model_space(model, merged.weights)
    tokens = tokens_for(merged.config)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), lora_run["model"](tokens), rtol=1e-5, atol=1e-5)


def test_the_exported_adapter_loads_in_peft_with_our_logits_and_merges_to_our_merged_export(lora_run, tmp_path):
    import json

    import transformers
    from safetensors import safe_open

    from mtnlg_lightning.interop.export_cli import main as export_main

    ckpt = str(lora_run["ckpt"] / "step=5.ckpt")
    assert export_main([ckpt, str(tmp_path / "adapter"), "--adapter"]) == 0
    assert export_main([ckpt, str(tmp_path / "merged")]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 8.0, False)
    assert config["base_model_name_or_path"] == str(lora_run["base"].resolve())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    pattern = r"base_model\.model\.model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.lora_[AB]\.weight"
    assert len(keys) == 2 * 7 * 2 and all(__import__("re").fullmatch(pattern, k) for k in keys)

    tokens = tokens_for(lora_run["model"].config)
    with torch.no_grad():
        ours = lora_run["model"](tokens)
    theirs, adapted = _peft_logits(lora_run["base"], tmp_path / "adapter", tokens)
    vocab = theirs.shape[-1]
    torch.testing.assert_close(theirs, ours[..., :vocab], rtol=1e-5, atol=1e-5)

    peft_merged = adapted.merge_and_unload().state_dict()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(peft_merged[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(tokens).logits, ours[..., :vocab], rtol=1e-5, atol=1e-5)


def test_adapter_export_of_a_checkpoint_without_lora_is_one_line(lora_run, tmp_path, capsys):
    from mtnlg_lightning.interop.export_cli import main as export_main

    assert export_main([str(lora_run["base"]), str(tmp_path / "out"), "--adapter"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds no LoRA adapter" in err and len(err.splitlines()) == 1


def test_a_resume_continues_the_uninterrupted_losses_on_the_same_base_and_refuses_another(lora_run, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from mtnlg_lightning.checkpoint.format import CheckpointError  # noqa: F401 - the error's family
    from testing.parallel_harness import tiny_run

    same = shutil.copytree(lora_run["base"], tmp_path / "same-base")  # another path, the same content
    rec, _ = tiny_run(init_from=str(same), lora=LORA_RUN, ckpt_path=lora_run["ckpt"] / "step=3.ckpt")
    assert rec.losses == pytest.approx(lora_run["losses"][3:], rel=1e-5)

    other = shutil.copytree(lora_run["base"], tmp_path / "other-base")
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MTNLGError, match="a base directory whose content differs from the one the adapter was"):
        tiny_run(init_from=str(other), lora=LORA_RUN, ckpt_path=lora_run["ckpt"] / "step=3.ckpt")


@pytest.fixture(scope="module")
def zero1_lora_state(lora_run):
    """One LoRA step under ZeRO-1 and bf16 (one process, gloo): the optimizer's bytes (DeepSpeed's fp32 master
    partitions and Adam's two moments), the adapter's and the model's parameters, and the model's config."""
    from mtnlg_lightning.parallel.deepspeed_compat import fp32_flat_partitions
    from mtnlg_lightning.parallel.zero import base_optimizer
    from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy
    from testing.parallel_harness import tiny_run

    strategy = MegatronDeepSpeedStrategy(zero_stage=1, print_layout=False)
    _, trainer = tiny_run(strategy, init_from=str(lora_run["base"]), lora=LORA_RUN, max_steps=1,
                          precision="bf16-mixed")  # fmt: skip
    optimizer = trainer.optimizers[0]
    inner = base_optimizer(optimizer)  # ZeRO-1/2: its param groups are the fp32 master partitions
    masters = fp32_flat_partitions(optimizer) or [p for group in inner.param_groups for p in group["params"]]
    state = inner.state
    moments = [t for s in state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    held = sum(t.numel() * t.element_size() for t in [*masters, *moments])
    model = trainer.lightning_module.model
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    everything = sum(p.numel() for p in model.parameters())
    return {"held": held, "adapter": adapter, "everything": everything, "config": model.config}


def test_zero1_holds_an_fp32_master_and_two_moments_for_the_adapter_only(zero1_lora_state):
    """ZeRO-1 under bf16: DeepSpeed's fp32 master and Adam's two moments, 12 bytes per adapter parameter, and
    nothing for the frozen base (DeepSpeed pads each flat partition to its alignment: a few elements)."""
    held, adapter, everything = (zero1_lora_state[k] for k in ("held", "adapter", "everything"))
    print(f"\nZeRO-1 optimizer state {held:,} bytes for {adapter:,} adapter parameters (12 x = {12 * adapter:,}); "
          f"full fine-tuning of the {everything:,} parameters: {12 * everything:,}")  # fmt: skip
    assert 12 * adapter <= held <= 12 * (adapter + 64)


def test_the_planner_sizes_the_optimizer_state_a_zero1_lora_run_holds(zero1_lora_state):
    """`mtnlg-plan --lora` of the same model and layout (one GPU, ZeRO-1, bf16): the adapters a run trains, and
    the optimizer bytes it holds (up to DeepSpeed's alignment padding)."""
    from mtnlg_lightning.planning.planner import plan

    planned = plan(zero1_lora_state["config"], 1, 1, 1, 1, "h100", 8, 4, "none", 1, lora=lora_config(LORA_RUN))
    assert planned.trainable_params == zero1_lora_state["adapter"]
    assert planned.frozen_params + planned.trainable_params == zero1_lora_state["everything"]
    optimizer_bytes = planned.optimizer_state_gb * 1e9
    assert optimizer_bytes == pytest.approx(12 * zero1_lora_state["adapter"], rel=1e-12)
    assert optimizer_bytes <= zero1_lora_state["held"] <= optimizer_bytes + 12 * 64


# ------------------------------------------------------------------------------------------------ layouts
LAYOUTS = ("tp2_sp", "pp2", "zero1", "zero3", "cp2", "tp2_acfull")  # world 2: zero1 and zero3 are dp2
WORLD8 = ("tp2_pp2_dp2_zero1",)


@pytest.fixture(scope="module")
def lora_run_long(lora_run):
    """The one-process LoRA run of the context-parallel layouts: 5 steps on sequences of LONG tokens."""
    from dist_family_runs import LONG

    from testing.parallel_harness import tiny_run

    rec, _ = tiny_run(init_from=str(lora_run["base"]), lora=LORA_RUN, seq_len=LONG)
    return {"losses": rec.losses, "grad_norms": rec.grad_norms, "params": rec.params}


def _launch(world: int, layouts: tuple[str, ...], out, base) -> dict:
    from pathlib import Path

    from testing.local_ranks import run_on_ranks

    here = Path(__file__).resolve().parent
    proc = run_on_ranks(world, here / "dist_lora_runs.py", out, base, *layouts, timeout=900, cwd=here.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in layouts}


@pytest.fixture(scope="module")
def lora_layout_runs(lora_run):
    return _launch(2, LAYOUTS, lora_run["root"] / "layouts", lora_run["base"])


@pytest.fixture(scope="module")
def lora_world8_runs(lora_run):
    return _launch(8, WORLD8, lora_run["root"] / "world8", lora_run["base"])


def assert_lora_trains_like(run: dict, reference: dict) -> None:
    """Losses (fp32, rel 1e-5), pre-clip gradient norms, the adapters after 5 clipped Adam steps and the untouched
    base."""
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(run["grad_norms"], reference["grad_norms"], rtol=1e-5, atol=0)
    params, expected = run["params"][5], reference["params"][5]
    assert params.keys() == expected.keys()
    adapters = [k for k in expected if k.endswith(("lora_a", "lora_b"))]
    assert adapters and max((params[k] - expected[k]).abs().max().item() for k in adapters) <= 2e-5
    assert all(torch.equal(params[k], expected[k]) for k in expected if k not in adapters)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_trains_alike_in_every_layout(layout, lora_layout_runs, request):
    """5 LoRA steps from a Llama directory: tp2 with sequence parallelism (adapters sharded like their bases),
    pp2, dp2 under ZeRO-1 and ZeRO-3 (frozen base, adapter-only optimizer), cp2 (against one process on the same
    longer sequences) and tp2 with every block's activations recomputed reproduce one process."""
    reference = request.getfixturevalue("lora_run_long" if "cp" in layout else "lora_run")
    assert_lora_trains_like(lora_layout_runs[layout], reference)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", WORLD8)
def test_lora_trains_alike_in_three_dimensions(layout, lora_world8_runs, lora_run):
    """tp2 x pp2 x dp2 under ZeRO-1 (8 ranks): adapters sharded over TP, split into pipeline stages, their
    optimizer state partitioned over DP, reproduce one process."""
    assert_lora_trains_like(lora_world8_runs[layout], lora_run)
