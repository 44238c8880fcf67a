"""The planner sizes preference tuning (`mtnlg-plan --dpo`): batches count pairs, two sequences each; full-weight
DPO holds a frozen copy of each GPU's weights (as many bytes as the copy the trainer takes), none when the
reference log-probs are precomputed or under LoRA; layouts the trainer refuses are refused in one line."""

from __future__ import annotations

import pytest

from mtnlg_lightning.config import get_config
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.planning.dpo_plan import preference_plan
from mtnlg_lightning.planning.plan_cli import main as plan_main
from mtnlg_lightning.planning.planner import plan, search

LLAMA = get_config("llama3.1-8b")


def dpo_plan(reference: str, zero_stage: int = 1, lora=None, **layout):
    dpo = preference_plan(reference, lora is not None, zero_stage)
    return plan(LLAMA, 8, 1, 2, 8, "h100", 64, zero_stage=zero_stage, lora=lora, dpo=dpo, **layout)


def test_a_reference_copy_holds_the_weights_of_the_gpu_and_precomputed_log_probs_hold_nothing():
    lm = plan(LLAMA, 8, 1, 2, 8, "h100", 64, zero_stage=1)
    copy, precomputed = dpo_plan("copy"), dpo_plan("precomputed")
    weights = 2 * lm.params_per_gpu  # bf16 weights of this GPU's shards
    assert copy.dpo["reference_gb"] * 1e9 == pytest.approx(weights)
    assert copy.model_state_gb - lm.model_state_gb == pytest.approx(weights / 1e9)
    assert precomputed.dpo["reference_gb"] == 0 and precomputed.model_state_gb == pytest.approx(lm.model_state_gb)


def test_a_pair_is_two_sequences_and_the_reference_pass_one_more_forward():
    lm_pairs_as_sequences = plan(LLAMA, 8, 1, 2, 8, "h100", 128, micro_batch=2, zero_stage=1)
    precomputed = dpo_plan("precomputed", micro_batch=1)
    assert precomputed.activation_gb == pytest.approx(lm_pairs_as_sequences.activation_gb)
    assert precomputed.iteration_seconds == pytest.approx(lm_pairs_as_sequences.iteration_seconds)
    copy = dpo_plan("copy", micro_batch=1)
    forward = (copy.breakdown["compute"] - copy.breakdown["recompute"]) / 3
    assert copy.breakdown["reference"] == pytest.approx(forward)
    assert copy.iteration_seconds == pytest.approx(precomputed.iteration_seconds + forward)
    assert precomputed.global_batch == 64  # batches stay counted in pairs, as the trainer counts them


def test_lora_dpo_holds_no_copy_and_zero3_needs_precomputed_log_probs_for_full_weights():
    from mtnlg_lightning.parallel.lora import LoRAConfig

    lora = LoRAConfig.from_dict({"rank": 16, "alpha": 32})
    assert dpo_plan("copy", zero_stage=3, lora=lora).dpo == {
        "reference": "base",
        "reference_gb": 0.0,
        "reference_forward": True,
    }
    with pytest.raises(MTNLGError, match="full-weight DPO under ZeRO-3 keeps no reference copy"):
        dpo_plan("copy", zero_stage=3)
    assert dpo_plan("precomputed", zero_stage=3).fits
    plans = search(LLAMA, 16, 8, "h100", 64, dpo_reference="copy")
    assert plans and all(p.zero_stage < 3 and p.dpo["reference"] == "copy" for p in plans)


def test_the_cli_prints_the_reference_and_refuses_in_one_line(capsys):
    args = ["--model", "llama3.1-8b", "--tp", "8", "--pp", "1", "--dp", "2", "--global-batch", "64"]
    assert plan_main([*args, "--zero-stage", "1", "--dpo", "copy"]) == 0
    out = capsys.readouterr().out
    assert "DPO                  pairs (2 sequences a sample); reference: a frozen copy of this GPU's weights" in out
    assert plan_main([*args, "--zero-stage", "3", "--dpo", "copy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dpo precomputed" in err[0]


@pytest.mark.slow
def test_the_planned_copy_is_the_copy_a_full_weight_dpo_run_takes(tmp_path):
    """fp32, one process, a Hugging Face Llama directory: the bytes of the reference copy the trainer holds equal
    the plan's."""
    from hf_models import random_family_dir
    from test_dpo import dpo_fit

    _, module = dpo_fit(random_family_dir(tmp_path / "base", "llama"), tmp_path / "run", 1)
    held = sum(t.numel() * t.element_size() for t in module.objective.reference_weights.copies)
    dpo = preference_plan("copy", False, 0)
    planned = plan(module.config, 1, 1, 1, 1, "h100", 4, zero_stage=0, precision="fp32", dpo=dpo)
    assert held > 0 and planned.dpo["reference_gb"] * 1e9 == pytest.approx(held, rel=1e-9)
