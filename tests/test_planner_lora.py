"""The planner sizes LoRA fine-tuning: the frozen base holds its weights only, the adapters (as many per GPU as
`apply_lora` makes and tensor parallelism leaves a rank) their weights, gradients and optimizer state (divided over
DP by ZeRO); full fine-tuning is the plan it always was. `--lora` takes `--model.lora`'s settings."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from threaded_group import run_ranks

from mtnlg_lightning.config import get_config
from mtnlg_lightning.model import build_model
from mtnlg_lightning.parallel.lora import LoRAConfig, apply_lora, shard_with_adapters
from mtnlg_lightning.parallel.tensor_parallel import apply_tensor_parallel
from mtnlg_lightning.planning.lora_plan import adapter_params_per_block
from mtnlg_lightning.planning.plan_cli import main as plan_main
from mtnlg_lightning.planning.planner import STATE_BYTES, model_state_bytes, plan

GPT_TINY = get_config("tiny")  # fused qkv
LLAMA_TINY = get_config("demo-llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=96)


def trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def lora_of(targets, rank: int = 16) -> LoRAConfig:
    return LoRAConfig.from_dict({"rank": rank, "alpha": 32} | ({"targets": targets} if targets else {}))


@pytest.mark.parametrize(
    ("preset", "targets"),
    [
        ("llama3.1-8b", None),  # every attention and MLP projection
        ("llama3.1-8b", ["q_proj", "v_proj"]),
        ("llama3.1-8b", ["o_proj", "down_proj"]),
        ("qwen3-8b", ["k_proj", "up"]),
        ("gpt3-1.3b", None),  # fused qkv, fc1 and fc2
        ("gpt3-1.3b", ["c_attn", "c_proj"]),  # GPT-2's names: qkv, the attention's and the MLP's output
    ],
)
def test_the_planned_adapters_are_the_ones_apply_lora_makes(preset, targets):
    config = get_config(preset)
    lora = lora_of(targets)
    model = build_model(config, "meta")
    apply_lora(model, lora)
    assert adapter_params_per_block(config, 1, lora) * config.num_layers == trainable(model)
    planned = plan(config, 1, 1, 8, 8, "h100", 64, zero_stage=1, lora=lora)
    assert planned.trainable_params == trainable(model)
    assert planned.frozen_params == sum(p.numel() for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize(
    ("config", "tp", "targets"),
    [
        (LLAMA_TINY, 2, None),
        (LLAMA_TINY, 2, ["k_proj", "o_proj"]),
        (LLAMA_TINY, 4, None),  # TP above the 2 key/value heads: each rank holds a copy of its head's B rows
        (GPT_TINY, 2, None),
    ],
    ids=["llama-tp2", "llama-tp2-k-o", "llama-tp4-kv-copies", "gpt-tp2"],
)
def test_the_planned_adapters_per_tensor_parallel_rank_are_the_ones_each_rank_holds(config, tp, targets):
    lora = lora_of(targets, rank=4)
    torch.manual_seed(0)
    reference = build_model(config)
    apply_lora(reference, lora)

    def rank_fn(rank):
        model = copy.deepcopy(reference)
        kv_group = None
        if not config.fused_qkv and tp > config.num_kv_heads:
            copies = tp // config.num_kv_heads
            pairs = [dist.new_group(list(range(s, s + copies))) for s in range(0, tp, copies)]
            kv_group = pairs[rank // copies]

        def shard():
            apply_tensor_parallel(model, dist.group.WORLD, rank, tp, False, kv_group)

        shard_with_adapters(model, shard, rank, tp, kv_group)
        return trainable(model)

    planned = plan(config, tp, 1, 1, tp, "h100", 8, lora=lora).trainable_params
    assert planned == adapter_params_per_block(config, tp, lora) * config.num_layers
    assert run_ranks(tp, rank_fn) == [planned] * tp


@pytest.mark.parametrize("dp", [1, 4])
def test_zero1_plans_12_bytes_of_optimizer_state_per_adapter_parameter_over_dp_and_only_weights_for_the_base(dp):
    config, lora = get_config("llama3.1-8b"), lora_of(None)
    model = build_model(config, "meta")
    apply_lora(model, lora)
    adapters, base = trainable(model), sum(p.numel() for p in model.parameters()) - trainable(model)
    p = plan(config, 1, 1, dp, 8, "h100", 64, recompute="full", zero_stage=1, lora=lora)
    assert p.optimizer_state_gb * 1e9 == pytest.approx(12 * adapters / dp, rel=1e-12)
    bf16 = STATE_BYTES["bf16"]
    expected = bf16["weights"] * (base + adapters) + bf16["grads"] * adapters + 12 * adapters / dp
    assert p.model_state_gb * 1e9 == pytest.approx(expected, rel=1e-12)
    assert p.lora["frozen_gb"] * 1e9 == pytest.approx(2 * base, rel=1e-12)
    full = plan(config, 1, 1, dp, 8, "h100", 64, recompute="full", zero_stage=1)
    assert full.lora is None and full.frozen_params == 0 and full.trainable_params == full.params_per_gpu
    assert full.optimizer_state_gb * 1e9 == pytest.approx(12 * full.params_per_gpu / dp, rel=1e-12)
    assert full.model_state_gb * 1e9 == pytest.approx(model_state_bytes(full.params_per_gpu, dp, 1), rel=1e-12)
    assert p.model_state_gb < full.model_state_gb / 4


def test_zero3_partitions_the_frozen_base_too():
    config, lora = get_config("llama3.1-8b"), lora_of(None)
    one, four = (plan(config, 1, 1, dp, 8, "h100", 64, zero_stage=3, lora=lora) for dp in (1, 4))
    assert four.lora["frozen_gb"] == pytest.approx(one.lora["frozen_gb"] / 4)
    assert four.model_state_gb == pytest.approx(one.model_state_gb / 4)


def test_plan_prints_the_frozen_base_and_the_adapters_in_text_and_json(capsys):
    argv = ["--model", "llama3.1-8b", "--seq", "4096", "--tp", "2", "--pp", "1", "--dp", "4", "--global-batch", "64"]
    argv += ["--gpu", "h100", "--lora", "{rank: 16, alpha: 32, targets: [q_proj, v_proj]}"]
    assert plan_main(argv) == 0
    text = capsys.readouterr().out
    assert "LoRA                 rank 16, alpha 32 on q, v of every block" in text
    assert "frozen base          4.015 B params per GPU" in text and "weights only" in text
    assert plan_main([*argv, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    lora = lora_of(["q_proj", "v_proj"])
    config = get_config("llama3.1-8b", seq_len=4096, max_position_embeddings=4096)
    assert found["trainable_params"] == 32 * adapter_params_per_block(config, 2, lora)
    assert found["frozen_params"] == found["params_per_gpu"]
    assert found["lora"]["targets"] == ["q", "v"] and found["lora"]["rank"] == 16
    assert plan_main([*argv[:-2], "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["lora"] is None and full["frozen_params"] == 0 and full["model_state_gb"] > 4 * found["model_state_gb"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{rank: 0}", "rank must be an integer > 0"),
        ("{targets: [fc1]}", "targets 'fc1', which this model does not have"),
        ("{rank: 16, alpha: 32", "--lora is not a YAML mapping"),
        ("16", "model.lora takes a mapping"),
        ("{ranks: 8}", "unknown field(s) ['ranks']"),
    ],
)
def test_a_bad_lora_value_is_one_line(value, message, capsys):
    argv = ["--model", "llama3.1-8b", "--tp", "1", "--pp", "1", "--global-batch", "8", "--lora", value]
    assert plan_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
