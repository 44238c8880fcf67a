"""What GRPO (`--model.objective grpo`) adds to a plan: the generation inside each training step.

- A sample is a prompt: each of the step's global batch of prompts gets num_generations (G) completions, each a
  training row of seq_len, so a step trains global batch x G sequences (their activations, compute and
  communication, as DPO's two a sample; the batch sizes stay counted in prompts, as the trainer counts them). That
  is the pipeline's row layout; elsewhere the trainer computes a prompt once for its G completions (`share_prompts`:
  one row of up to prompt + G x max_completion_length positions), fewer positions: the plan's upper bound.
- The generation (`train/objectives/rollouts.py`, `ShardedModel.decoding`): each data-parallel replica decodes its
  share of the rows, global batch x G / DP, in one batch in the training layout (TP splits the key/value heads, PP
  the layers), with a KV cache of up to seq_len positions: a prompt of up to seq_len - max_completion_length tokens
  (the longest the data keeps) and max_completion_length new ones. The plan takes every prompt that long and every
  completion to its end: the upper bound of a step. Sequence and context parallelism are suspended while decoding:
  each TP rank decodes whole sequences (as plain TP), and each CP rank of a replica runs the replica's whole decode
  (its KV cache and prefill hold whole rows of seq_len positions, not seq_len / CP).
  Memory: the training state stays held while generating (weights, gradients, optimizer states, a reference copy), but
  no training activation is alive then: the GPU's peak is the larger of the training peak and the states + the KV
  cache + the prefill's working set (one layer's forward and the last stage's fp32 logits of every prompt token).
  Under ZeRO-3 every rank gathers its TP shard of the whole parameters (unpartitioned over DP, DeepSpeed's
  per-module hooks off) for the generation and partitions them again after: the gathered weights (its stage's
  weight bytes, not / DP) join the generating peak, and one all-gather of them over the replicas its time.
  Time: the prefill (one forward of the prompts: compute-bound) and max_completion_length decode steps, each reading
  the rank's weights and its sequences' KV cache so far at HBM bandwidth (memory-bound; the slower of reading and
  computing, over the steps). The stages decode one after another (one micro-batch), so a step reads the rank's TP
  shard of every stage. Left out: TP's all-reduces per token and the sampling.
- num_iterations mu: the data serves each global batch of prompts mu times in a row; the first of those steps
  generates (and runs the forward-only passes: the reference's when beta > 0, and with mu > 1 the policy's own, the
  "old" log-probs), the next mu - 1 train again on the same rows. A step's time counts the generation (prefill,
  decode, the ZeRO-3 gather) and those forwards divided by mu. With mu > 1 the rows (input ids, labels and
  positions, 8 bytes each a token) and the last stage's per-token log-probs (old, sampling, and the reference's
  when beta > 0: 4 bytes each) are kept between steps: in both peaks (small next to the rest).
- The reference: beta 0, none; beta > 0, one more forward of the trained rows each generation, and for full weights
  a frozen copy of each rank's weights (`preference.ReferenceWeights`, as DPO's copy: `dpo_plan.PreferencePlan`), for
  LoRA the base with its adapters off (nothing held).
- What the trainer refuses (`grpo.GRPO.check_layout`, `data/prompts.py`) is refused in one line: full-weight GRPO
  with beta > 0 under ZeRO-3 (no reference copy kept), and num_iterations > 1 with a batch ramp-up.
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
    "base" (LoRA); up to `max_completion_length` new tokens after each prompt; `num_iterations` (mu) steps a
    generation."""

    max_completion_length: int = 512
    beta: float = 0.0
    num_iterations: int = 1

    def refusal(self, zero_stage: int, rampup: bool = False) -> str | None:
        """Why the trainer does not run GRPO in this layout (its own words, with the planner's flags), or None."""
        if self.reference == "copy" and zero_stage >= 3:
            return (
                "full-weight GRPO with beta > 0 under ZeRO-3 keeps no reference copy: use --lora (the reference is "
                "the base with its adapters off), beta 0, or --zero-stage 1 or 2"
            )
        if rampup and self.num_iterations > 1:
            return (
                "--grpo num_iterations > 1 serves each global batch of prompts several times, which a batch ramp-up "
                "would cut differently: drop --rampup or use num_iterations 1"
            )
        return None

    def prompt_tokens(self, seq_len: int) -> int:
        """The longest prompt the data keeps (`GRPO.max_prompt_tokens`)."""
        return seq_len - self.max_completion_length

    def memory(self, config: ModelConfig, layers: int, rows: int, tp: int, dtype: str, last: bool) -> tuple:
        """(KV cache, prefill working set) bytes of a rank holding `layers` blocks that generates `rows` whole
        sequences (under CP too: every CP rank of a replica decodes the replica's rows)."""
        kv = kv_cache_bytes(config, layers, rows, config.seq_len, tp, dtype)
        prompt = self.prompt_tokens(config.seq_len)
        working, logits = forward_working_bytes(config, rows, prompt, tp, DTYPE_BYTES[dtype])
        return kv, working + (logits if last else 0.0)

    def kept_bytes(self, rows: int, seq_len: int, last: bool) -> float:
        """What num_iterations > 1 keeps between steps of a rank generating `rows` sequences: the rows (input ids,
        labels, positions: int64) and, on the last stage, the per-token log-probs (fp32: the old ones, the
        sampling ones, and the reference's when beta > 0); nothing with num_iterations 1."""
        if self.num_iterations == 1:
            return 0.0
        logps = (2 + (self.beta > 0)) if last else 0
        return rows * seq_len * (3 * 8 + 4 * logps)

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
        gathered, kept, generating and training peaks of the fullest GPU) and seconds ((prefill, decode, gather) of
        one generation, which a step of `step_seconds` counts divided by num_iterations); `rows`: the sequences one
        GPU generates."""
        generation = sum(seconds)
        per_step = generation / self.num_iterations
        return {
            "num_generations": self.sequences_per_sample,
            "max_completion_length": self.max_completion_length,
            "beta": self.beta,
            "num_iterations": self.num_iterations,
            "reference": self.reference,
            "reference_gb": reference_bytes / 1e9,
            "reference_forward": self.reference_forward,
            "sequences_per_gpu": rows,
            "prompt_tokens": memory["prompt"],
            **{
                f"{name}_gb": memory[name] / 1e9
                for name in ("kv_cache", "prefill_working", "gathered_weights", "kept_rows", "generation", "training")
            },
            **dict(zip(("prefill_seconds", "decode_seconds", "gather_seconds"), seconds, strict=True)),
            "generation_seconds": generation,  # one generation
            "step_generation_seconds": per_step,  # in each step's time: the generation over num_iterations steps
            "training_seconds": step_seconds - per_step,
            "generation_share": per_step / step_seconds,
        }


def parse_grpo(text: str, config: ModelConfig, lora: bool) -> GRPOPlan:
    """`--grpo '{num_generations: 8, max_completion_length: 256, beta: 0.0}'` as `--model.grpo` takes it (every key
    optional, TRL's defaults), checked against `config` (one line for a bad value)."""
    from mtnlg_lightning.grpo_loss import GRPOConfig  # imports torch (seconds): only when --grpo is given

    try:
        settings = GRPOConfig.from_mapping(flag_yaml(text, "--grpo", "{num_generations: 8, beta: 0.0}"))
    except MTNLGError as error:
        raise MTNLGError(str(error).replace("model.grpo", "--grpo", 1)) from None
    if settings.max_completion_length >= config.seq_len:
        raise MTNLGError(
            f"--grpo max_completion_length {settings.max_completion_length} leaves no room for a prompt in seq_len "
            f"{config.seq_len}: lower it or raise seq_len (--seq)"
        )
    reference = "none" if not settings.beta else "base" if lora else "copy"
    return GRPOPlan(
        reference, settings.num_generations, settings.max_completion_length, settings.beta, settings.num_iterations
    )


def format_grpo(summary: dict) -> list[str]:
    """The plan's GRPO lines, from `Plan.grpo`."""
    held = {
        "none": "none (beta 0)",
        "copy": f"beta {summary['beta']:g}, a frozen copy of this GPU's weights, {summary['reference_gb']:,.3f} GB",
        "base": f"beta {summary['beta']:g}, the base with the adapters off (no copy)",
    }[summary["reference"]]
    mu = summary.get("num_iterations", 1)
    gb = lambda name: f"{summary[name + '_gb']:,.1f} GB"  # noqa: E731
    s = lambda name: f"{summary[name + '_seconds']:,.2f} s"  # noqa: E731
    rows, prompt, new = (summary[k] for k in ("sequences_per_gpu", "prompt_tokens", "max_completion_length"))
    if mu == 1:
        forward = "; one more forward of the rows each step" if summary["reference_forward"] else ""
    else:  # the reference's and the old log-probs' forwards run with the generation, once every mu steps
        passes = "two more forwards of its rows (the reference's and the old log-probs')"
        if not summary["reference_forward"]:
            passes = "one more forward of its rows (the old log-probs')"
        forward = f"; num_iterations {mu}: each generation trains {mu} steps, after {passes}"
    parts = f"prefill {s('prefill')}, decode {s('decode')}"
    if summary.get("gather_seconds"):
        parts += f", ZeRO-3 gather {s('gather')}"
    share = f"{summary['generation_share']:.0%}"
    if mu == 1:
        timing = f"{s('generation')} a step ({share}: {parts})"
    else:
        timing = f"{s('generation')} once every {mu} steps ({parts}): {s('step_generation')} a step ({share})"
    beside = f"KV cache {gb('kv_cache')} + prefill {gb('prefill_working')}"
    if summary.get("gathered_weights_gb"):
        beside += f" + gathered weights {gb('gathered_weights')} (ZeRO-3)"
    if summary.get("kept_rows_gb"):  # megabytes: small next to the rest
        beside += f" + kept rows {summary['kept_rows_gb'] * 1e3:,.1f} MB"
    return [
        f"  GRPO                 {summary['num_generations']} completions a prompt, {rows} rows per GPU (prompts up to "
        f"{prompt:,} + {new:,} new tokens); reference: {held}{forward}",
        f"  GRPO generation      {timing} beside training {s('training')}; {beside} beside the model states: "
        f"{gb('generation')} (training peak {gb('training')})",
    ]
