"""What GRPO (`--model.objective grpo`) adds to a plan: the generation inside each training step.

- A sample is a prompt: each of the step's global batch of prompts gets num_generations (G) completions, each a
  training row of seq_len, so a step trains global batch x G sequences (their activations, compute and
  communication, as DPO's two a sample; the batch sizes stay counted in prompts, as the trainer counts them).
- The generation (`train/objectives/rollouts.py`): each data-parallel replica decodes its share of the rows, global
  batch x G / DP, in one batch in the training layout (TP splits the key/value heads, PP the layers), with a KV cache
  of up to seq_len positions: a prompt of up to seq_len - max_completion_length tokens (the longest the data keeps)
  and max_completion_length new ones. The plan takes every prompt that long and every completion to its end: the
  upper bound of a step.
  Memory: the training state stays held while generating (weights, gradients, optimizer states, a reference copy), but
  no training activation is alive then: the GPU's peak is the larger of the training peak and the states + the KV
  cache + the prefill's working set (one layer's forward and the last stage's fp32 logits of every prompt token).
  Time: the prefill (one forward of the prompts: compute-bound) and max_completion_length decode steps, each reading
  the rank's weights and its sequences' KV cache so far at HBM bandwidth (memory-bound; the slower of reading and
  computing, over the steps). The stages decode one after another (one micro-batch), so a step reads the rank's TP
  shard of every stage. Left out: TP's all-reduces per token and the sampling.
- The reference: beta 0, none; beta > 0, one more forward of the trained rows each step, and for full weights a
  frozen copy of each rank's weights (`preference.ReferenceWeights`, as DPO's copy: `dpo_plan.PreferencePlan`), for
  LoRA the base with its adapters off (nothing held).
- What the trainer refuses (`grpo.GRPO.check_layout`) is refused in one line: ZeRO-3, context parallelism, sequence
  parallelism, num_iterations > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.gpus import GPUSpec
from mtnlg_lightning.planning.activations import DTYPE_BYTES, forward_working_bytes, kv_cache_bytes
from mtnlg_lightning.planning.dpo_plan import PreferencePlan
from mtnlg_lightning.planning.lora_plan import flag_yaml
from mtnlg_lightning.train.flops import forward_flops_per_token

ONE_OBJECTIVE = "--dpo and --grpo are two objectives (--model.objective dpo or grpo): plan one of them"


@dataclass(frozen=True)
class GRPOPlan(PreferencePlan):
    """GRPO's step: `sequences_per_sample` = G rows a prompt; the reference "none" (beta 0), "copy" (full weights) or
    "base" (LoRA); up to `max_completion_length` new tokens after each prompt."""

    max_completion_length: int = 512
    beta: float = 0.0

    def refusal(self, zero_stage: int, cp: int, sequence_parallel: bool) -> str | None:
        """Why the trainer does not run GRPO in this layout (its own words), or None."""
        if sequence_parallel:
            return "GRPO's generation cuts no sequence over TP: train it with sequence_parallel false"
        if cp > 1:
            return "GRPO's generation cuts no sequence over context-parallel ranks: use context_parallel 1"
        if zero_stage >= 3:
            return "GRPO's generation under ZeRO-3 is not built yet: use zero_stage 1 or 2"
        return None

    def prompt_tokens(self, seq_len: int) -> int:
        """The longest prompt the data keeps (`GRPO.max_prompt_tokens`)."""
        return seq_len - self.max_completion_length

    def memory(self, config: ModelConfig, layers: int, rows: int, tp: int, dtype: str, last: bool) -> tuple:
        """(KV cache, prefill working set) bytes of a rank holding `layers` blocks that generates `rows` sequences."""
        kv = kv_cache_bytes(config, layers, rows, config.seq_len, tp, dtype)
        prompt = self.prompt_tokens(config.seq_len)
        working, logits = forward_working_bytes(config, rows, prompt, tp, DTYPE_BYTES[dtype])
        return kv, working + (logits if last else 0.0)

    def seconds(self, config: ModelConfig, gpu: GPUSpec, weight_bytes: float, rows: int, tp: int, dtype: str) -> tuple:
        """(prefill, decode) seconds of generating `rows` sequences on a rank whose TP shard of all the stages holds
        `weight_bytes`."""
        prompt, new = self.prompt_tokens(config.seq_len), self.max_completion_length
        compute = gpu.peak_tflops * 1e12 * gpu.gemm_efficiency
        hbm = gpu.hbm_tbps * 1e12 * gpu.hbm_efficiency
        prefill = rows * prompt * forward_flops_per_token(config, prompt) / tp / compute
        # Decode step t (1..C) reads the cache of prompt + t positions and attends over them: both are linear in
        # that length, so the C steps sum to C times their value at the mean length, prompt + (C + 1) / 2.
        mean = prompt + (new + 1) / 2
        read = new * (weight_bytes + kv_cache_bytes(config, config.num_layers, rows, mean, tp, dtype))
        flops = new * rows * forward_flops_per_token(config, mean) / tp
        return prefill, max(read / hbm, flops / compute)

    def summary(self, reference_bytes: float, rows: int, memory: dict, seconds: tuple, step_seconds: float) -> dict:
        """The plan's `grpo` entry: the settings, the reference, and the generation's bytes (`memory`: kv, working,
        generating and training peaks of the fullest GPU) and seconds ((prefill, decode) of a step of
        `step_seconds`); `rows`: the sequences one GPU generates."""
        prefill, decode = seconds
        return {
            "num_generations": self.sequences_per_sample,
            "max_completion_length": self.max_completion_length,
            "beta": self.beta,
            "reference": self.reference,
            "reference_gb": reference_bytes / 1e9,
            "reference_forward": self.reference_forward,
            "sequences_per_gpu": rows,
            "prompt_tokens": memory["prompt"],
            **{f"{name}_gb": memory[name] / 1e9 for name in ("kv_cache", "prefill_working", "generation", "training")},
            "prefill_seconds": prefill,
            "decode_seconds": decode,
            "generation_seconds": prefill + decode,
            "training_seconds": step_seconds - prefill - decode,
            "generation_share": (prefill + decode) / step_seconds,
        }


def parse_grpo(text: str, config: ModelConfig, lora: bool) -> GRPOPlan:
    """`--grpo '{num_generations: 8, max_completion_length: 256, beta: 0.0}'` as `--model.grpo` takes it (every key
    optional, TRL's defaults), checked against `config` and the trainer's refusals (one line for a bad value)."""
    from mtnlg_lightning.grpo_loss import GRPOConfig  # imports torch (seconds): only when --grpo is given

    try:
        settings = GRPOConfig.from_mapping(flag_yaml(text, "--grpo", "{num_generations: 8, beta: 0.0}"))
    except MTNLGError as error:
        raise MTNLGError(str(error).replace("model.grpo", "--grpo", 1)) from None
    if settings.num_iterations != 1:
        raise MTNLGError("--grpo num_iterations > 1 (several updates per generated batch) is not built yet: use 1")
    if settings.max_completion_length >= config.seq_len:
        raise MTNLGError(
            f"--grpo max_completion_length {settings.max_completion_length} leaves no room for a prompt in seq_len "
            f"{config.seq_len}: lower it or raise seq_len (--seq)"
        )
    reference = "none" if not settings.beta else "base" if lora else "copy"
    return GRPOPlan(reference, settings.num_generations, settings.max_completion_length, settings.beta)


def format_grpo(summary: dict) -> list[str]:
    """The plan's GRPO lines, from `Plan.grpo`."""
    held = {
        "none": "none (beta 0)",
        "copy": f"beta {summary['beta']:g}, a frozen copy of this GPU's weights, {summary['reference_gb']:,.3f} GB",
        "base": f"beta {summary['beta']:g}, the base with the adapters off (no copy)",
    }[summary["reference"]]
    forward = "; one more forward of the rows each step" if summary["reference_forward"] else ""
    gb = lambda name: f"{summary[name + '_gb']:,.1f} GB"  # noqa: E731
    s = lambda name: f"{summary[name + '_seconds']:,.2f} s"  # noqa: E731
    rows, prompt, new = (summary[k] for k in ("sequences_per_gpu", "prompt_tokens", "max_completion_length"))
    return [
        f"  GRPO                 {summary['num_generations']} completions a prompt, {rows} rows per GPU (prompts up to "
        f"{prompt:,} + {new:,} new tokens); reference: {held}{forward}",
        f"  GRPO generation      {s('generation')} a step ({summary['generation_share']:.0%}: prefill {s('prefill')}, "
        f"decode {s('decode')}) beside training {s('training')}; KV cache {gb('kv_cache')} + prefill "
        f"{gb('prefill_working')} beside the model states: {gb('generation')} (training peak {gb('training')})",
    ]
