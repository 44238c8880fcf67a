"""What preference tuning (DPO, `--model.objective dpo`) adds to a plan.

- A sample is a pair: every micro-batch carries two sequences per sample, so activations, compute and
  communication are those of twice the sequences (the batch sizes stay counted in pairs, as the trainer counts
  them).
- The reference pass is one more forward of those sequences, without gradients, each step (not when the data
  brings precomputed log-probs: `data.precompute_reference`, one forward pass over the data before the first step).
- What the reference holds: with LoRA, nothing (the base with its adapters off); full-weight DPO, a frozen copy of
  each rank's weights sharded as the policy's (weights only), or nothing when precomputed. The copy is of a rank's
  own shards, which ZeRO-3 does not keep: full weights under ZeRO-3 need the precomputed log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtnlg_lightning.errors import MTNLGError

REFERENCES = ("copy", "precomputed")  # full-weight DPO's reference; LoRA's is always the base with adapters off


@dataclass(frozen=True)
class PreferencePlan:
    """What a sample trains beside its sequences' own pass: `sequences_per_sample` rows and a reference (DPO's; GRPO's
    `grpo_plan.GRPOPlan` too, whose reference may be "none")."""

    reference: str  # "copy", "precomputed" or "base" (LoRA)

    sequences_per_sample: int = 2

    @property
    def reference_forward(self) -> bool:
        """Whether each step runs the reference's forward pass (a copy's, or the base's with adapters off)."""
        return self.reference in ("copy", "base")

    def reference_bytes(self, weight_bytes: float) -> float:
        """What the reference holds beside a rank's weights of `weight_bytes`."""
        return weight_bytes if self.reference == "copy" else 0.0

    def summary(self, reference_bytes: float) -> dict:
        """The plan's `dpo` entry: the reference and what it holds on the fullest stage's GPU."""
        return {
            "reference": self.reference,
            "reference_gb": reference_bytes / 1e9,
            "reference_forward": self.reference_forward,
        }


def preference_plan(reference: str, lora: bool, zero_stage: int) -> PreferencePlan:
    """`--dpo REFERENCE` checked against the run (one line for a layout that cannot hold it)."""
    if reference not in REFERENCES:
        raise MTNLGError(f"--dpo must be one of {', '.join(REFERENCES)}, got {reference!r}")
    if lora:
        return PreferencePlan("base")
    if reference == "copy" and zero_stage >= 3:
        raise MTNLGError(
            "full-weight DPO under ZeRO-3 keeps no reference copy: --dpo precomputed (data.precompute_reference), "
            "--lora, or ZeRO 1 or 2"
        )
    return PreferencePlan(reference)


def format_dpo(summary: dict) -> str:
    """The plan's DPO line, from `Plan.dpo`."""
    held = {
        "copy": f"a frozen copy of this GPU's weights, {summary['reference_gb']:,.3f} GB",
        "precomputed": "log-probs precomputed with the data (no copy)",
        "base": "the base with the adapters off (no copy)",
    }[summary["reference"]]
    forward = "one more forward of the pairs each step" if summary["reference_forward"] else "no pass per step"
    return f"  DPO                  pairs (2 sequences a sample); reference: {held}; {forward}"
