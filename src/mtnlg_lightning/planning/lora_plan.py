"""What a LoRA run holds on one GPU: the frozen base (its weights only: no gradient, no optimizer state) and the
adapters (weights, gradients and optimizer state, as any trained parameter).

The adapters are counted as `parallel/lora.py` shards them: over a column-parallel base A (r, in) is whole and
B (out, r) split like the base's rows; over a row-parallel base A is split like its columns and B whole. Either
way an adapter holds r x (the base's output rows + input columns on this rank), `families.linear_shapes_per_rank`
(a key/value head replicated over several ranks brings its B rows with it). Under ZeRO the base is partitioned
over data parallelism at stage 3 only (DeepSpeed partitions every parameter, frozen ones too); the adapters'
gradients and optimizer state are divided as `planner.model_state_parts` divides a full model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import yaml

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import layer_kind, linear_shapes_per_rank
from mtnlg_lightning.parallel.lora import PROJECTIONS, LoRAConfig, layer_projections, lora_config


def flag_yaml(text: str, flag: str, example: str):
    """The value of a `FLAG YAML` option as YAML reads it (a YAML error in one line naming `flag` and `example`)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise MTNLGError(f"{flag} is not a YAML mapping such as '{example}': {first}") from None


def parse_lora(text: str, config: ModelConfig) -> LoRAConfig:
    """`--lora '{rank: 16, alpha: 32, targets: [q_proj, v_proj]}'` as `--model.lora` takes it, its targets checked
    against `config` (one line for a bad value)."""
    lora = lora_config(flag_yaml(text, "--lora", "{rank: 16, alpha: 32}"))
    lora.projections(config)
    return lora


def adapter_params_per_block(config: ModelConfig, tp: int, lora: LoRAConfig) -> int:
    """Adapter parameters one of `tp` tensor-parallel ranks holds for one block, the mean over the model's layers
    (a Gated DeltaNet layer adapts its own projections, not the attention's)."""
    names, per_kind, held = lora.projections(config), {}, 0
    for index in range(config.num_layers):
        kind = layer_kind(config, index)
        if kind not in per_kind:  # one count per block kind (the planner asks for many layouts)
            shapes = linear_shapes_per_rank(config, tp, kind)
            parts = (shapes[PROJECTIONS[name]] for name in layer_projections(config, names, index))
            per_kind[kind] = sum(lora.rank * int(rows + columns) for _, rows, columns in parts)
        held += per_kind[kind]
    return round(held / config.num_layers)


@dataclass(frozen=True)
class StageState:
    """Model-state bytes of one pipeline stage's GPU: what trains (every parameter in full fine-tuning, the adapters
    under LoRA) and what is frozen (nothing, or the base)."""

    frozen_params: int
    trainable_params: int
    frozen_bytes: float  # weights only
    weight_bytes: float  # of the trainable parameters, and their
    grad_bytes: float
    optimizer_bytes: float  # the fp32 master and Adam's moments (12 bytes per parameter in bf16) / DP under ZeRO

    @property
    def total(self) -> float:
        return self.frozen_bytes + self.weight_bytes + self.grad_bytes + self.optimizer_bytes


def stage_state(
    parts: Callable[[int], tuple[float, float, float]],
    params: int,
    layers: int,
    config: ModelConfig,
    tp: int,
    lora: LoRAConfig | None,
    experts: int = 0,
    expert_parts: Callable[[int], tuple[float, float, float]] | None = None,
) -> StageState:
    """A stage's GPU holding `params` model parameters in `layers` blocks, `experts` of them a mixture of experts'.
    `parts(n)`: the (weights, gradients, optimizer) bytes of n trained parameters on this GPU
    (`planner.model_state_parts` of the layout's precision and ZeRO), `expert_parts(n)` the same of experts
    (partitioned over their own replicas; default `parts`); a frozen parameter has its weight only. `lora` None:
    full fine-tuning."""
    expert_parts = expert_parts or parts
    base = tuple(a + b for a, b in zip(parts(params - experts), expert_parts(experts), strict=True))
    if lora is None:
        return StageState(0, params, 0.0, *base)
    adapters = layers * adapter_params_per_block(config, tp, lora)
    return StageState(params, adapters, base[0], *parts(adapters))


def lora_summary(lora: LoRAConfig, config: ModelConfig, state: StageState) -> dict:
    """The plan's `lora` entry: the settings, the projections they target and the fullest stage's bytes."""
    return {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "dropout": lora.dropout,
        "rslora": lora.rslora,
        "targets": list(lora.projections(config)),
        "frozen_gb": state.frozen_bytes / 1e9,
        "adapter_weights_gb": state.weight_bytes / 1e9,
        "adapter_grads_gb": state.grad_bytes / 1e9,
        "adapter_optimizer_gb": state.optimizer_bytes / 1e9,
    }


def format_lora(summary: dict, frozen_params: int, trainable_params: int, zero_stage: int) -> list[str]:
    """The plan's LoRA lines (the fullest stage's GPU), from `lora_summary`."""
    gb = lambda x: f"{x:,.3f} GB"  # noqa: E731
    weights, grads, optimizer = (summary[f"adapter_{k}_gb"] for k in ("weights", "grads", "optimizer"))
    return [
        f"  LoRA                 rank {summary['rank']}, alpha {summary['alpha']:g}"
        f"{' (rsLoRA)' if summary['rslora'] else ''} on {', '.join(summary['targets'])} of every block",
        f"  frozen base          {frozen_params / 1e9:,.3f} B params per GPU: {gb(summary['frozen_gb'])} "
        f"(weights only: no gradient, no optimizer state)",
        f"  trainable adapters   {trainable_params / 1e6:,.3f} M params per GPU: {gb(weights + grads + optimizer)} "
        f"(weights {gb(weights)}, gradients {gb(grads)}, optimizer state {gb(optimizer)}, ZeRO-{zero_stage})",
    ]
