"""GRPO (`--model.objective grpo`): generation inside the step, completions that do not depend on the layout, the
loss and updates of one process in every layout the generation runs in, a resume that samples what the run that
never stopped samples, a policy that learns a reward, and bad settings in one line. The loss arithmetic itself is
TRL's (tests/test_grpo_loss.py), the prompt data and the reward functions are tests/test_prompts_rewards.py's."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hf_models import random_family_dir, random_moe_dir

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.grpo_loss import completion_logps
from mtnlg_lightning.inference.decode import sequence_seed
from mtnlg_lightning.loss import IGNORE_INDEX
from mtnlg_lightning.model import build_model
from mtnlg_lightning.train.objectives import build_objective
from mtnlg_lightning.train.objectives.rollouts import (
    CompletionSlots,
    completion_rows,
    completion_seeds,
    shared_prompt_rows,
)

HERE = Path(__file__).resolve().parent
# 2 ranks: data parallelism (plain, ZeRO-1 and ZeRO-3), TP (with and without SP), PP, CP; with the KL (the reference
# pass), LoRA, ZeRO-2 and -3; a Qwen 3-MoE's experts split over the ranks (moe_ep2); the LM head's scores in chunks
# of 8 tokens, recomputed in the backward (_chunked); a checkpoint
GRPO_LAYOUTS = (
    "dp2", "tp2", "tp2_sp", "pp2", "cp2", "zero1", "zero3", "dp2_kl", "tp2_kl", "tp2_lora", "pp2_kl_lora",
    "zero2_kl_lora", "zero3_kl_lora", "cp2_kl_lora", "moe_ep2", "dp2_mu2", "tp2_sp_kl_chunked", "cp2_chunked",
)  # fmt: skip
LOW_IDS = '''
def low_ids(prompts, completions, completion_ids, **columns):
    """The share of a completion's tokens in the lower half of the 4096-token vocabulary."""
    return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]
'''


@pytest.fixture(scope="module")
def grpo_inputs(tmp_path_factory):
    """(base directory, prompts file, reward spec): a random Llama directory with the demo tokenizer, 64 prompts with
    an answer column, and a reward a policy can learn in a few steps."""
    root = tmp_path_factory.mktemp("grpo")
    base = random_family_dir(root, "llama")
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Count on from {i}:", "answer": str(i + 1)}) + "\n" for i in range(64))
    )
    (root / "grpo_rewards.py").write_text(LOW_IDS)
    return str(base), str(prompts), f"{root / 'grpo_rewards.py'}:low_ids"


@pytest.fixture(scope="module")
def grpo_runs(grpo_inputs, tmp_path_factory):
    """3 GRPO steps in one process (full weights, LoRA, each with and without the KL; a Qwen 3-MoE with its
    router losses), then the layouts in one 2-rank launch."""
    from dist_grpo_runs import GRPO_LORA, grpo_run

    from testing.local_ranks import run_on_ranks

    base, prompts, rewards = grpo_inputs
    moe_dir = tmp_path_factory.mktemp("grpo_moe")  # its router's auxiliary loss on, as transformers trains it
    moe = str(random_moe_dir(moe_dir, "qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.01))
    runs = {
        "one": grpo_run(base, prompts, rewards),
        "one_kl": grpo_run(base, prompts, rewards, beta=0.04),
        "one_lora": grpo_run(base, prompts, rewards, lora=GRPO_LORA),
        "one_lora_kl": grpo_run(base, prompts, rewards, lora=GRPO_LORA, beta=0.04),
        "one_moe": grpo_run(moe, prompts, rewards),
        "one_mu2": grpo_run(base, prompts, rewards, mu=2),
    }
    out = tmp_path_factory.mktemp("grpo_layouts")
    names = (*GRPO_LAYOUTS, "dp2_ckpt", "dp2_mu2_ckpt")
    proc = run_on_ranks(
        2, HERE / "dist_grpo_runs.py", out, base, moe, prompts, rewards, *names, timeout=900, cwd=HERE.parent
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return runs | {name: torch.load(out / f"{name}.pt", weights_only=False) for name in names} | {"out": out}


def reference_of(layout: str) -> str:
    if layout.startswith("moe_"):
        return "one_moe"
    if layout.endswith("_mu2"):
        return "one_mu2"
    return "one" + ("_lora" if "_lora" in layout else "") + ("_kl" if "_kl" in layout else "")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", GRPO_LAYOUTS)
def test_grpo_samples_and_trains_alike_in_every_layout(layout, grpo_runs):
    """dp2 (each replica generates its prompts' completions; the rewards gathered before the advantages), tp2 (the
    sampler on TP rank 0, the log-probs and entropy vocabulary-parallel), pp2 (the decoder through the stages, the
    loss on the last), tp2 with SP and cp2 (the decoder on whole sequences: `ShardedModel.decoding` suspends both;
    the loss on SP's gathered and CP's chunked rows), ZeRO-1, -2 and -3 (ZeRO-3's parameters gathered whole and its
    hooks off while decoding: the replicas decode different numbers of passes), the KL's reference pass (a frozen
    copy, or LoRA's adapters off), a Qwen 3-MoE with its experts over 2 ranks (ep2: the replicas' decoders kept in
    step; the router losses join the GRPO loss) reproduce one process: every step's completions token for token
    (steps 2 and 3 sample the updated policy), the rewards, the losses (rel 1e-5, atol 1e-7: on-policy GRPO's loss
    is ~0 without the KL), the pre-clip gradient norms (5e-5: one process's fp32 norm) and the weights after 3
    clipped Adam steps (2e-5). With num_iterations 2 (dp2_mu2) step 2 trains again on step 1's completions."""
    run, one = grpo_runs[layout], grpo_runs[reference_of(layout)]
    assert run["completions"] == one["completions"]
    assert len(one["completions"]) == 3 and len(one["completions"][0]) == 16  # 4 prompts x 4 completions a step
    assert run["rewards"] == pytest.approx(one["rewards"], rel=1e-6)
    torch.testing.assert_close(run["losses"], one["losses"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(run["grad_norms"], one["grad_norms"], rtol=5e-5, atol=0)
    params, expected = run["params"][3], one["params"][3]
    assert params.keys() == expected.keys()
    assert max((params[k] - expected[k]).abs().max().item() for k in expected) <= 2e-5
    if "_kl" in layout:  # the KL term is in the loss: steps 2 and 3 move off the reference
        assert min(one["losses"][1:]) > 1e-5
    if "_mu2" in layout:  # num_iterations 2: step 2 trains again on step 1's completions, off-policy (clipped)
        assert one["completions"][1] == one["completions"][0] != one["completions"][2]
        assert abs(one["losses"][1]) > 1e-3 > abs(one["losses"][0])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_dp2_checkpoint_resumes_in_one_process_with_the_same_next_completions_and_loss(grpo_inputs, grpo_runs):
    """The data position and the sampling seeds are in the checkpoint: the dp2 run's step-2 checkpoint, resumed in one
    process, samples step 3's completions as the uninterrupted run does, with its loss and weights."""
    from dist_grpo_runs import grpo_run

    checkpoint = grpo_runs["out"] / "dp2_ckpt_checkpoints" / "step=2.ckpt"
    resumed = grpo_run(*grpo_inputs, ckpt_path=checkpoint)
    one = grpo_runs["one"]
    assert grpo_runs["dp2_ckpt"]["completions"] == one["completions"]
    assert resumed["completions"] == one["completions"][2:]
    torch.testing.assert_close(resumed["losses"], one["losses"][2:], rtol=1e-5, atol=1e-7)
    apart = max((resumed["params"][3][k] - v).abs().max().item() for k, v in one["params"][3].items())
    assert apart <= 2e-5


@pytest.mark.slow
@pytest.mark.distributed
def test_a_checkpoint_inside_a_generations_iterations_resumes_on_the_same_rows(grpo_inputs, grpo_runs):
    """num_iterations 2: the dp2 run's step-1 checkpoint holds the generation that step 2 trains on again (every
    replica's completions, the rewards, the generating policy's log-probs); resumed in one process, step 2 trains on
    the same rows against the same log-probs and step 3 samples the uninterrupted run's completions, with its losses
    and weights."""
    from dist_grpo_runs import grpo_run

    checkpoint = grpo_runs["out"] / "dp2_mu2_ckpt_checkpoints" / "step=1.ckpt"
    resumed = grpo_run(*grpo_inputs, mu=2, ckpt_path=checkpoint)
    one = grpo_runs["one_mu2"]
    assert resumed["completions"] == one["completions"][1:]
    torch.testing.assert_close(resumed["losses"], one["losses"][1:], rtol=1e-5, atol=1e-7)
    apart = max((resumed["params"][3][k] - v).abs().max().item() for k, v in one["params"][3].items())
    assert apart <= 2e-5


@pytest.mark.slow
def test_a_validation_between_a_generations_iterations_leaves_the_training_rows_in_place(grpo_inputs, grpo_runs):
    """num_iterations 2 with a validation after every step: the validation generates its own completions, and step
    2 still trains again on step 1's rows: the same losses and weights as the run without validation."""
    from dist_grpo_runs import grpo_run

    validated = grpo_run(*grpo_inputs, mu=2, validate_every=1)
    one = grpo_runs["one_mu2"]
    assert validated["completions"] == one["completions"]
    torch.testing.assert_close(validated["losses"], one["losses"], rtol=1e-6, atol=1e-8)


@pytest.mark.slow
def test_a_policy_learns_a_reward_and_logs_trls_metric_names(grpo_inputs, tmp_path):
    """16 steps of 4 prompts x 8 completions, full weights: the reward of the last 4 steps is well above the first 4
    steps' (measured: 0.52 -> 0.82 on average); the metrics carry TRL's names; the sampling/training probability
    ratio of the sampled tokens is 1.0 (1e-5); the completions table is written every 8 steps."""
    from conftest import run_cli

    base, prompts, rewards = grpo_inputs
    args = ["fit", "--config", "grpo", "--model.init_from", base, "--data.train", prompts, "--data.chat_template",
            "chatml", "--model.rewards", f"[{rewards}]",
            "--model.grpo", "{num_generations: 8, max_completion_length: 16, log_completions_every_n_steps: 8}",
            "--model.model_overrides", "{seq_len: 64}", "--model.global_batch_size", "4", "--model.lr", "2e-2",
            "--model.min_lr", "2e-2", "--model.lora", "null", "--trainer.max_steps", "16", "--trainer.precision",
            "32-true", "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.callbacks", "[]"]  # fmt: skip
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    rewards_by_step = [float(row["reward"]) for row in rows if row.get("reward")]
    assert len(rewards_by_step) == 16
    first, last = sum(rewards_by_step[:4]) / 4, sum(rewards_by_step[-4:]) / 4
    assert last > first + 0.15, rewards_by_step
    names = {key for row in rows for key, value in row.items() if value}
    expected = {"reward", "reward_std", "rewards/low_ids/mean", "rewards/low_ids/std", "frac_reward_zero_std",
                "completions/mean_length", "completions/min_length", "completions/max_length",
                "completions/clipped_ratio", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                "clip_ratio/region_mean", "timing/generation_s", "timing/training_s", "train_loss",
                "sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/mean"}  # fmt: skip
    assert expected <= names, expected - names
    # the health check: the sampler's log-probabilities of the sampled tokens are the trained ones (fp32, no update
    # between sampling and the forward of the same step)
    ratios = [float(row["sampling/importance_sampling_ratio/mean"]) for row in rows if row.get("reward")]
    assert ratios == pytest.approx([1.0] * 16, abs=1e-5)
    # the completions table: the first 2 prompts' 8 completions as text with their rewards, at steps 8 and 16
    table = [json.loads(line) for line in open(next(tmp_path.rglob("completions.jsonl")))]
    assert [row["step"] for row in table] == [8] * 16 + [16] * 16
    assert {"prompt", "completion", "low_ids"} <= table[0].keys() and table[0]["prompt"].startswith("Count on from")


def test_each_completion_token_is_labelled_at_the_position_that_predicts_it():
    rows = completion_rows([[5, 6, 7], [8]], [[9, 10], []], seq_len=6, pad_id=0)
    assert rows["input_ids"].tolist() == [[5, 6, 7, 9, 10, 0], [8, 0, 0, 0, 0, 0]]
    ignore = IGNORE_INDEX
    assert rows["labels"].tolist() == [[ignore, ignore, 9, 10, ignore, ignore], [ignore] * 6]
    assert rows["position_ids"].tolist() == [list(range(6))] * 2


def test_a_shared_prompt_row_computes_the_prompt_once_and_branches_each_completion_off_it():
    rows = shared_prompt_rows([[5, 6, 7]], [[9, 10], [11], [], [12, 13, 14]], width=10, pad_id=0, longest=3)
    ignore = IGNORE_INDEX
    # the prompt but its last token; each branch: the prompt's last token, then the completion's but its last
    assert rows["input_ids"].tolist() == [[5, 6, 7, 9, 7, 7, 12, 13, 0, 0]]
    assert rows["labels"].tolist() == [[ignore, ignore, 9, 10, 11, 12, 13, 14, ignore, ignore]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 2, 2, 3, 4, 0, 1]]
    assert rows["slots"].tolist() == [[-1, -1, 0, 1, 3, 9, 10, 11, -1, -1]]  # branch j's token t at j x 3 + t
    spread = CompletionSlots(rows["slots"], 4, 3).spread(rows["labels"])
    assert spread.tolist() == [[9, 10, 0], [11, 0, 0], [0, 0, 0], [12, 13, 14]]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_shared_prompt_rows_give_each_completion_the_log_probs_and_gradients_of_a_row_of_its_own(family):
    """What makes sharing the prompt a pure saving: the same per-token log-probabilities and the same gradient of
    any loss of them as one row per completion (fp32), with half the positions here."""
    config = get_config("tiny") if family == "gpt" else get_config("demo-llama", num_layers=2, hidden_size=64)
    torch.manual_seed(0)
    model = build_model(config)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 500, (n,), generator=generator).tolist() for n in (12, 7)]
    completions = [torch.randint(1, 500, (n,), generator=generator).tolist() for n in (5, 3, 6, 1, 4, 6)]
    repeated = [p for p in prompts for _ in range(3)]
    weights = torch.randn(6, 6, generator=generator)  # a loss of the log-probs: any weighting of them

    def scored(rows: dict, branches: int) -> tuple[torch.Tensor, dict]:
        model.zero_grad()
        inputs = {key: rows[key] for key in ("position_ids", "document_ids") if key in rows}
        logps = completion_logps(model(rows["input_ids"], **inputs), rows["labels"], 1.0)
        logps = CompletionSlots(rows["slots"], branches, 6).spread(logps)
        (logps * weights).sum().backward()
        return logps.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    alone, alone_grads = scored(completion_rows(repeated, completions, 32, pad_id=0), 1)
    shared_rows = shared_prompt_rows(prompts, completions, 32, pad_id=0, longest=6)
    shared, shared_grads = scored(shared_rows, 3)
    counted = torch.tensor([[t < len(c) for t in range(6)] for c in completions])
    assert bool((alone[~counted] == 0).all()) and bool((alone[counted] != 0).all())
    torch.testing.assert_close(shared, alone, rtol=0, atol=1e-5)
    for name, grad in alone_grads.items():
        scale = max(grad.abs().max().item(), 1.0)
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6 * scale, msg=name)
    # the positions computed: (12 - 1) + 14 and (7 - 1) + 11, against 3 x 12 + 14 and 3 x 7 + 11
    assert int((shared_rows["input_ids"] != 0).sum()) == 42
    assert sum(len(p) + len(c) for p, c in zip(repeated, completions, strict=True)) == 82


def test_a_completion_is_seeded_by_its_prompts_place_in_the_data_stream_and_its_index_in_the_group():
    seeds = completion_seeds(1234, first_sample=10, prompts=2, generations=3)
    assert seeds == [sequence_seed(1234, s * 3 + g) for s in (10, 11) for g in range(3)]
    # a replica holding samples 11.. draws for sample 11 what one process holding 10.. draws
    assert completion_seeds(1234, first_sample=11, prompts=1, generations=3) == seeds[3:]


def grpo_settings(**grpo) -> dict:
    return {"objective": "grpo", "grpo": grpo, "rewards": ["length"], "reward_weights": None}


def test_bad_grpo_settings_and_layouts_are_one_line_each():
    with pytest.raises(MTNLGError, match=r"^model\.objective grpo needs model\.rewards"):
        build_objective({"objective": "grpo", "grpo": None, "rewards": None})
    with pytest.raises(MTNLGError, match=r"num_generations"):
        build_objective(grpo_settings(num_generations=1))
    objective = build_objective(grpo_settings(max_completion_length=64))
    with pytest.raises(MTNLGError, match=r"^model\.grpo max_completion_length 64 leaves no room for a prompt"):
        objective.max_prompt_tokens(64)
    full_weights, with_kl = SimpleNamespace(frozen_base=False), build_objective(grpo_settings(beta=0.04))
    with pytest.raises(MTNLGError, match=r"^full-weight GRPO with beta > 0 under ZeRO-3 keeps no reference copy"):
        with_kl.check_layout(full_weights, SimpleNamespace(zero_stage=3))
    with_kl.check_layout(SimpleNamespace(frozen_base=True), SimpleNamespace(zero_stage=3))  # LoRA: adapters off


@pytest.mark.slow
def test_grpo_without_a_model_directory_is_one_line(tmp_path):
    from conftest import run_cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    proc = run_cli("fit", "--config", "grpo", "--data.train", str(prompts), "--model.rewards", "[length]", cwd=tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("mtnlg: error: model.lora needs model.init_from")


@pytest.mark.slow
def test_a_lora_grpo_checkpoint_exports_a_peft_adapter_and_a_merged_model_with_the_trained_logits(
    grpo_inputs, tmp_path
):
    """`mtnlg-export-hf CKPT OUT --adapter` and `mtnlg-export-hf CKPT OUT` after GRPO, as after SFT: PEFT's base +
    adapter and transformers' merged directory give the same logits, which are not the base's."""
    import peft
    import transformers
    from dist_grpo_runs import GRPO_LORA, grpo_run
    from lightning.pytorch.callbacks import ModelCheckpoint

    from mtnlg_lightning.interop.export_cli import main as export_main

    base = grpo_inputs[0]
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    grpo_run(*grpo_inputs, lora=GRPO_LORA, callbacks=[saving])
    checkpoint = str(tmp_path / "ckpt" / "step=3.ckpt")
    assert export_main([checkpoint, str(tmp_path / "adapter"), "--adapter"]) == 0
    assert export_main([checkpoint, str(tmp_path / "merged")]) == 0
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        base_model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        adapted = peft.PeftModel.from_pretrained(base_model, tmp_path / "adapter").eval()
        torch.testing.assert_close(adapted(tokens).logits, merged(tokens).logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, merged(tokens).logits, rtol=1e-5, atol=1e-5)


def test_the_demo_prompts_are_the_instruction_questions_with_their_answers(tmp_path):
    """scripts/grpo_demo.sh's prompts: TRL's conversational form (system and user turns), the answer as a column
    the shipped accuracy reward reads, one task's questions when asked; and the curve it prints comes from the
    run's metrics."""
    from mtnlg_lightning.demo.synthetic.instructions import answer_of, main, prompt_records, reward_curve

    records = prompt_records(20, seed=3)
    assert all([turn["role"] for turn in r["prompt"]] == ["system", "user"] for r in records)
    assert all(r["answer"] == answer_of(r["prompt"][-1]["content"]) for r in records)
    assert main(["prompts", str(tmp_path / "run"), "--count", "20", "--tasks", "length"]) == 0
    lines = (tmp_path / "run" / "prompts.jsonl").read_text().splitlines()
    assert len(lines) == 20  # the demo's task alone: how many letters a word has
    assert all(json.loads(line)["prompt"][-1]["content"].startswith("How many letters are in ") for line in lines)
    metrics = tmp_path / "run" / "lightning_logs" / "version_0" / "metrics.csv"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("reward,step\n0.25,0\n,0\n0.75,1\n")
    assert reward_curve(tmp_path / "run", window=1).startswith("reward by step: 0.25 0.75\nfirst 1 steps 0.250 -> last")


def test_dotted_grpo_settings_on_the_command_line_are_read_in_their_types():
    """`--model.grpo.temperature 0.8` reaches the mapping as the string "0.8" (a dict's value types are unknown to the
    parser): a string for a setting that is not a string is read as YAML."""
    from mtnlg_lightning.grpo_loss import GRPOConfig

    config = GRPOConfig.from_mapping(
        {"temperature": "0.8", "top_k": "null", "num_generations": "4", "loss_type": "grpo"}
    )
    assert (config.temperature, config.top_k, config.num_generations, config.loss_type) == (0.8, None, 4, "grpo")
    with pytest.raises(MTNLGError, match=r"^model\.grpo temperature must be a number > 0, got 'hot'$"):
        GRPOConfig.from_mapping({"temperature": "hot"})
