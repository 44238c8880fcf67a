"""The planner sizes GRPO (`mtnlg-plan --grpo`): a step trains global batch x G sequences (as DPO's two a sample);
before it, each GPU generates its share of them with a KV cache of 2 x layers x kv_heads x head_dim x bytes per
token (its own layers under PP, its own key/value heads under TP) held beside the model states (no training
activation is alive then: the peak is the larger of the two); the decode reads the GPU's weights and the cache so far
once per new token (memory-bound), so its time grows with max_completion_length; beta > 0 adds a reference pass and,
for full weights, a frozen copy of the weights (none under LoRA). Every layout generates, as the trainer: under ZeRO-3
the gathered weights join the generating peak, under CP every rank decodes its replica's whole rows, and
num_iterations spreads a generation over its steps; what the trainer refuses is refused in one line."""

from __future__ import annotations

import json

import pytest

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.gpus import get_gpu
from mtnlg_lightning.planning.dpo_plan import preference_plan
from mtnlg_lightning.planning.grpo_plan import format_grpo, parse_grpo
from mtnlg_lightning.planning.plan_cli import main as plan_main
from mtnlg_lightning.planning.planner import plan, search

SMALL = get_config("llama3.2-1b", seq_len=1024)  # 16 layers, 8 key/value heads of 64


SETTINGS = "{num_generations: 4, max_completion_length: 256}"


def grpo_plan(settings: str = SETTINGS, *layout, config=SMALL, lora=None, **kwargs):
    """`config` (default Llama 3.2 1B at 1024 tokens) on `layout` (tp, pp, dp; default 2 x 2 x 2 H100s), 8 prompts a
    step."""
    tp, pp, dp = layout or (2, 2, 2)
    grpo = parse_grpo(settings, config, lora is not None)
    kwargs = {"zero_stage": 1, "recompute": "selective", **kwargs}
    return plan(config, tp, pp, dp, 8, "h100", 8, lora=lora, grpo=grpo, **kwargs)


def test_the_kv_cache_is_each_gpus_layers_and_key_value_heads_for_its_share_of_the_sequences():
    rows = 8 * 4 // 2  # 8 prompts x G 4 over DP 2
    per_token = 2 * (16 // 2) * (8 // 2) * 64 * 2  # 2 x its 8 layers (PP 2) x its 4 key/value heads (TP 2) x bf16
    planned = grpo_plan()
    assert planned.grpo["sequences_per_gpu"] == rows
    assert planned.grpo["kv_cache_gb"] * 1e9 == pytest.approx(per_token * rows * 1024)  # prompt + completion: seq
    whole = grpo_plan(SETTINGS, 1, 1, 2).grpo
    assert whole["kv_cache_gb"] == pytest.approx(4 * planned.grpo["kv_cache_gb"])  # every layer, every head
    fp32 = grpo_plan(precision="fp32").grpo
    assert fp32["kv_cache_gb"] == pytest.approx(2 * planned.grpo["kv_cache_gb"])


def test_a_step_trains_global_batch_x_g_sequences_as_many_rows_of_language_modelling_would():
    grpo = grpo_plan(micro_batch=1)
    lm = plan(SMALL, 2, 2, 2, 8, "h100", 8 * 4, micro_batch=4, zero_stage=1, recompute="selective")
    assert grpo.activation_gb == pytest.approx(lm.activation_gb)
    assert grpo.flops_per_iteration == pytest.approx(lm.flops_per_iteration)
    assert grpo.grpo["training_seconds"] == pytest.approx(lm.iteration_seconds)
    assert grpo.iteration_seconds == pytest.approx(lm.iteration_seconds + grpo.grpo["generation_seconds"])
    assert grpo.grpo["training_gb"] == pytest.approx(lm.total_gb)
    assert grpo.global_batch == 8  # batches stay counted in prompts, as the trainer counts them


def test_the_peak_is_the_larger_of_training_and_the_states_beside_the_kv_cache_and_the_prefill():
    planned = grpo_plan(SETTINGS, 1, 1, 1, recompute="full")
    g = planned.grpo
    assert g["generation_gb"] == pytest.approx(planned.model_state_gb + g["kv_cache_gb"] + g["prefill_working_gb"])
    assert g["training_gb"] == pytest.approx(planned.model_state_gb + planned.activation_gb)
    assert g["generation_gb"] > g["training_gb"]  # 32 sequences generated at once, 4 a micro-batch recomputed
    assert planned.total_gb == pytest.approx(g["generation_gb"])
    # 32 rows a micro-batch, every activation kept
    training_peak = grpo_plan(SETTINGS, 1, 1, 1, recompute="none", micro_batch=8)
    assert training_peak.grpo["training_gb"] > training_peak.grpo["generation_gb"]
    assert training_peak.total_gb == pytest.approx(training_peak.grpo["training_gb"])


def test_each_new_token_reads_the_gpus_weights_and_the_cache_so_far_once():
    gpu, rows, prompt = get_gpu("h100"), 8 * 4, 128
    hbm = gpu.hbm_tbps * 1e12 * gpu.hbm_efficiency
    per_token = 2 * 16 * 8 * 64 * 2 * rows  # the KV bytes of one position of every sequence (TP 1, PP 1)
    decode = {}
    for new in (64, 128, 256, 512):
        config = get_config("llama3.2-1b", seq_len=prompt + new)  # the same prompts, longer completions
        planned = grpo_plan(f"{{num_generations: 4, max_completion_length: {new}}}", 1, 1, 1, config=config)
        weights = 2 * planned.params_per_gpu
        steps = sum(weights + per_token * (prompt + t) for t in range(1, new + 1)) / hbm
        assert planned.grpo["decode_seconds"] == pytest.approx(steps)
        assert planned.grpo["prompt_tokens"] == prompt
        decode[new] = planned.grpo["decode_seconds"]
    # dominated by the weights read once per token: twice the tokens, about twice the time (the cache adds a little)
    for new in (64, 128, 256):
        assert 2 <= decode[2 * new] / decode[new] < 2.2
    assert planned.grpo["prefill_seconds"] < planned.grpo["decode_seconds"]


def test_beta_holds_a_copy_of_the_weights_with_full_weights_and_none_under_lora():
    none, copy = grpo_plan(SETTINGS, 2, 1, 2), grpo_plan("{num_generations: 4, beta: 0.04}", 2, 1, 2)
    assert none.grpo["reference"] == "none" and not none.grpo["reference_forward"]
    assert none.breakdown["reference"] == 0
    assert copy.grpo["reference"] == "copy"
    assert copy.grpo["reference_gb"] * 1e9 == pytest.approx(2 * copy.params_per_gpu)  # bf16 weights of this GPU
    assert copy.model_state_gb - none.model_state_gb == pytest.approx(copy.grpo["reference_gb"])
    forward = (copy.breakdown["compute"] - copy.breakdown["recompute"]) / 3
    assert copy.breakdown["reference"] == pytest.approx(forward)
    from mtnlg_lightning.parallel.lora import LoRAConfig

    lora = grpo_plan("{beta: 0.04, max_completion_length: 256}", lora=LoRAConfig.from_dict({"rank": 16, "alpha": 32}))
    assert lora.grpo["reference"] == "base" and lora.grpo["reference_gb"] == 0 and lora.grpo["reference_forward"]
    assert lora.grpo["num_generations"] == 8  # TRL's default for a key left out


def test_under_zero3_the_generating_peak_holds_the_gathered_weights_of_the_gpus_tp_shard():
    from mtnlg_lightning.parallel.lora import LoRAConfig

    lora = LoRAConfig.from_dict({"rank": 16, "alpha": 32})
    beta = "{num_generations: 4, max_completion_length: 256, beta: 0.04}"
    z3, z2 = (grpo_plan(beta, 2, 1, 4, lora=lora, zero_stage=z) for z in (3, 2))
    g = z3.grpo
    held = z3.frozen_params + z3.trainable_params  # the base's TP shard of every layer, and the adapters
    assert z3.frozen_params == z2.frozen_params == z3.params_per_gpu
    assert g["gathered_weights_gb"] * 1e9 == pytest.approx(2 * held)  # bf16, whole over DP: not / DP 4
    assert z3.lora["frozen_gb"] * 1e9 == pytest.approx(2 * z3.frozen_params / 4)  # while training: partitioned
    assert g["generation_gb"] == pytest.approx(
        z3.model_state_gb + g["kv_cache_gb"] + g["prefill_working_gb"] + g["gathered_weights_gb"]
    )
    assert z3.total_gb == pytest.approx(max(g["generation_gb"], g["training_gb"]))
    assert z2.grpo["gathered_weights_gb"] == 0 and z2.grpo["gather_seconds"] == 0
    assert g["kv_cache_gb"] == pytest.approx(z2.grpo["kv_cache_gb"])
    assert g["decode_seconds"] == pytest.approx(z2.grpo["decode_seconds"])
    # one all-gather of the weights over DP 4 (3/4 of them arrive) before the decode, in the step's generation
    assert 0 < g["gather_seconds"] < g["decode_seconds"]
    assert g["generation_seconds"] == pytest.approx(g["prefill_seconds"] + g["decode_seconds"] + g["gather_seconds"])
    assert z3.breakdown["generation"] == pytest.approx(g["generation_seconds"])
    line = format_grpo(g)[1]
    assert f"gathered weights {g['gathered_weights_gb']:,.1f} GB (ZeRO-3)" in line and "ZeRO-3 gather" in line
    full = grpo_plan(SETTINGS, 2, 1, 4, zero_stage=3).grpo  # full weights, beta 0: no reference, planned too
    assert full["gathered_weights_gb"] * 1e9 == pytest.approx(2 * grpo_plan(SETTINGS, 2, 1, 4).params_per_gpu)


def test_under_context_parallelism_every_rank_decodes_its_replicas_whole_rows():
    cp1, cp2 = (grpo_plan(SETTINGS, 2, 1, 2, cp=cp) for cp in (1, 2))  # 4 and 8 GPUs, the same DP 2
    assert cp2.cp == 2 and cp2.activation_gb < cp1.activation_gb  # training: each rank holds half of each row
    assert cp2.grpo["sequences_per_gpu"] == cp1.grpo["sequences_per_gpu"] == 8 * 4 // 2  # the replica's rows
    per_token = 2 * 16 * (8 // 2) * 64 * 2  # every layer, TP 2's key/value heads, bf16
    assert cp2.grpo["kv_cache_gb"] * 1e9 == pytest.approx(per_token * 16 * 1024)  # whole rows: seq_len, not / CP
    for key in ("kv_cache_gb", "prefill_working_gb", "prefill_seconds", "decode_seconds"):
        assert cp2.grpo[key] == pytest.approx(cp1.grpo[key])
    sp = grpo_plan(SETTINGS, 2, 1, 2, sequence_parallel=True)  # SP is suspended while decoding: plain TP
    assert sp.sequence_parallel and sp.activation_gb < cp1.activation_gb
    for key in ("kv_cache_gb", "prefill_working_gb", "generation_seconds"):
        assert sp.grpo[key] == pytest.approx(cp1.grpo[key])


def test_num_iterations_spreads_the_generation_and_its_forwards_over_its_steps():
    settings = "{{num_generations: 4, max_completion_length: 256, beta: 0.04, num_iterations: {}}}"
    one, two = (grpo_plan(settings.format(mu), 2, 1, 2) for mu in (1, 2))
    g1, g2 = one.grpo, two.grpo
    assert g2["num_iterations"] == 2 and g1["num_iterations"] == 1
    assert g2["generation_seconds"] == pytest.approx(g1["generation_seconds"])  # one generation
    assert g2["step_generation_seconds"] == pytest.approx(g1["step_generation_seconds"] / 2)  # a step's half of it
    assert g1["step_generation_seconds"] == pytest.approx(g1["generation_seconds"])
    forward = (one.breakdown["compute"] - one.breakdown["recompute"]) / 3
    assert one.breakdown["reference"] == pytest.approx(forward) and one.breakdown["old_logps"] == 0
    assert two.breakdown["reference"] == pytest.approx(forward / 2)  # with the generation, once every 2 steps
    assert two.breakdown["old_logps"] == pytest.approx(forward / 2)  # the old log-probs: one more forward, too
    assert two.iteration_seconds == pytest.approx(one.iteration_seconds - g1["generation_seconds"] / 2)
    # the rows (3 int64 tensors) and the last stage's log-probs (old, sampling, reference: fp32) kept between steps
    rows = 8 * 4 // 2
    assert g1["kept_rows_gb"] == 0
    assert g2["kept_rows_gb"] * 1e9 == pytest.approx(rows * 1024 * (3 * 8 + 3 * 4))
    assert g2["generation_gb"] == pytest.approx(g1["generation_gb"] + g2["kept_rows_gb"])
    assert g2["training_gb"] == pytest.approx(g1["training_gb"] + g2["kept_rows_gb"])
    line = format_grpo(g2)
    assert "num_iterations 2: each generation trains 2 steps, after two more forwards of its rows" in line[0]
    assert f"{g2['generation_seconds']:,.2f} s once every 2 steps" in line[1] and "kept rows 0.6 MB" in line[1]


def test_what_the_trainer_refuses_is_refused_in_one_line_and_searched_around():
    full_reference = "{num_generations: 4, beta: 0.04}"
    with pytest.raises(MTNLGError, match="full-weight GRPO with beta > 0 under ZeRO-3 keeps no reference copy: use"):
        grpo_plan(full_reference, 2, 1, 4, zero_stage=3)
    with pytest.raises(MTNLGError, match="which a batch ramp-up would cut differently: drop --rampup"):
        grpo_plan("{num_iterations: 2}", rampup=(4, 4, 64))
    with pytest.raises(MTNLGError, match="--dpo and --grpo are two objectives"):
        grpo_plan(dpo=preference_plan("copy", False, 1))
    plans = search(SMALL, 8, 8, "h100", 8, grpo=parse_grpo(full_reference, SMALL, False))
    assert plans and all(p.zero_stage < 3 and p.grpo for p in plans)
    assert any(p.cp > 1 for p in plans) and any(p.sequence_parallel for p in plans)


CLI = ["--model", "llama3.2-1b", "--seq", "1024", "--tp", "2", "--pp", "1", "--dp", "4", "--gpu", "h100"]


REFUSED = {  # the flags after the layout's: the one line that refuses them
    ("--grpo", "[8, 256]"): "--grpo must be a mapping of GRPO settings",
    ("--grpo", "{generations: 8}"): "--grpo: unknown key(s) ['generations']",
    ("--grpo", "{num_generations: 8"): "--grpo is not a YAML mapping",
    ("--grpo", "{num_generations: 1}"): "--grpo num_generations 1",
    ("--grpo", "{num_iterations: 2}", "--rampup", "4", "4", "64"): "drop --rampup or use num_iterations 1",
    ("--grpo", "{max_completion_length: 1024}"): "leaves no room for a prompt in seq_len 1024",
    ("--grpo", "{}", "--dpo", "copy"): "--dpo and --grpo are two objectives",
    ("--grpo", "{beta: 0.04}", "--zero-stage", "3"): "full-weight GRPO with beta > 0 under ZeRO-3 keeps no",
}


@pytest.mark.parametrize("extra", REFUSED)
def test_the_cli_refuses_bad_input_in_one_line(capsys, extra):
    assert plan_main([*CLI, "--global-batch", "16", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and REFUSED[extra] in err[0]


def test_the_cli_prints_the_generation_and_its_json_holds_the_entry(capsys):
    args = [*CLI, "--global-batch", "16", "--grpo", "{num_generations: 8, max_completion_length: 256, beta: 0.0}"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "  GRPO                 8 completions a prompt, 32 rows per GPU (prompts up to 768 + 256 new tokens)" in out
    assert "  GRPO generation      " in out and "GRPO generation" in out.splitlines()[-1]  # in the time breakdown
    assert plan_main([*args, "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["grpo"]
    assert entry["num_generations"] == 8 and entry["sequences_per_gpu"] == 32 and entry["reference"] == "none"
    assert entry["generation_seconds"] == pytest.approx(entry["prefill_seconds"] + entry["decode_seconds"])
    with pytest.raises(SystemExit):
        plan_main(["--help"])
    assert "--grpo YAML" in capsys.readouterr().out
