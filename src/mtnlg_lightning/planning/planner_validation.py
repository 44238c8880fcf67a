"""The planner against published runs: predicted vs published throughput, and where search ranks the published
layout. The runs live in `mtnlg_lightning/planning/published_runs.yaml` with their sources."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import yaml

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError, one_line
from mtnlg_lightning.planning.cost_model import IMPLEMENTATIONS
from mtnlg_lightning.planning.planner import Plan, best_per_layout, plan, search
from mtnlg_lightning.train.flops import flops_per_iteration

DEFAULT_PATH = Path(__file__).with_name("published_runs.yaml")
METRICS = ("tflops_per_gpu_with_recompute", "model_tflops_per_gpu", "iteration_seconds")
UNITS = {
    "tflops_per_gpu_with_recompute": "{:g} TFLOP/s (recompute counted)",
    "model_tflops_per_gpu": "{:g} TFLOP/s",
    "iteration_seconds": "{:g} s",
}
GPUS_PER_NODE = 8  # every published run is on DGX-style 8-GPU nodes


@dataclass
class PublishedRun:
    name: str
    source: str
    gpu: str
    implementation: str
    model: ModelConfig
    layout: dict
    global_batch: int
    metric: str
    value: float

    @property
    def gpus(self) -> int:
        return self.layout["tp"] * self.layout["pp"] * self.layout["dp"]

    def seconds(self) -> float:
        """The published iteration time (from the published throughput where that is what was reported)."""
        if self.metric == "iteration_seconds":
            return self.value
        flops = flops_per_iteration(self.model, self.global_batch, recompute=self.metric.endswith("with_recompute"))
        return flops / (self.value * 1e12 * self.gpus)


def load_runs(path: str | Path = DEFAULT_PATH) -> tuple[dict, list[PublishedRun]]:
    """The published runs of a YAML file; a missing file, bad YAML or a missing field is one line."""
    try:
        return _parse_runs(path, yaml.safe_load(Path(path).read_text(encoding="utf-8")))
    except (OSError, yaml.YAMLError) as error:
        raise MTNLGError(f"{path}: {one_line(error)}") from None
    except (KeyError, TypeError, ValueError) as error:
        if isinstance(error, MTNLGError):
            raise
        raise MTNLGError(f"{path}: not a published-runs file ({type(error).__name__}: {one_line(error)})") from None


def _parse_runs(path, data) -> tuple[dict, list[PublishedRun]]:
    sources, runs = data["sources"], []
    for row in data["runs"]:
        if row["source"] not in sources or row["implementation"] not in IMPLEMENTATIONS:
            raise MTNLGError(f"{path}: run {row['name']} names an unknown source or implementation")
        ((metric, value),) = row["published"].items()
        if metric not in METRICS:
            raise MTNLGError(f"{path}: run {row['name']} has unknown metric {metric!r}; known: {METRICS}")
        model = ModelConfig(**row["model"], name=row["name"])
        runs.append(
            PublishedRun(
                row["name"],
                row["source"],
                row["gpu"],
                row["implementation"],
                model,
                row["layout"],
                row["global_batch"],
                metric,
                float(value),
            )  # fmt: skip
        )
    return sources, runs


def predict(run: PublishedRun) -> Plan:
    """The planner's plan for the published layout; fields the source does not publish (null) take the fastest
    choice that fits in memory."""
    impl = IMPLEMENTATIONS[run.implementation]
    fixed = run.layout
    options = {
        "micro_batch": [fixed["micro_batch"]] if fixed.get("micro_batch") else [1, 2, 4, 8],
        "virtual_stages": [fixed["virtual_stages"]]
        if fixed.get("virtual_stages")
        else [v for v in range(1, impl.max_virtual_stages + 1) if v == 1 or fixed["pp"] > 1],
        "recompute": [fixed["recompute"]] if fixed.get("recompute") else list(impl.recompute_modes),
        "sequence_parallel": [fixed["sequence_parallel"]]
        if fixed.get("sequence_parallel") is not None
        else ([False, True] if impl.sequence_parallel and fixed["tp"] > 1 else [False]),
    }
    candidates = []
    for micro, v, recompute, sp in itertools.product(*options.values()):
        m = run.global_batch // (micro * fixed["dp"])
        if run.global_batch % (micro * fixed["dp"]) or (v > 1 and m % fixed["pp"]):
            continue
        if not impl.runs_pipeline(run.model.num_layers, fixed["pp"], v):
            continue  # e.g. Megatron-LM: no interleaving on 2 stages, layers split evenly over the chunks
        candidates.append(
            plan(
                run.model,
                fixed["tp"],
                fixed["pp"],
                fixed["dp"],
                GPUS_PER_NODE,
                run.gpu,
                run.global_batch,
                micro,
                recompute,
                fixed["zero_stage"],
                virtual_stages=v,
                sequence_parallel=sp,
                implementation=impl,
            )  # fmt: skip
        )
    if not candidates:
        raise MTNLGError(
            f"run {run.name}: no micro-batch / virtual-stage choice of tp {fixed['tp']} pp {fixed['pp']} dp "
            f"{fixed['dp']} divides the batch or runs on {run.implementation} ({run.model.num_layers} layers)"
        )
    fitting = [p for p in candidates if p.fits] or candidates
    return min(fitting, key=lambda p: p.iteration_seconds)


def throughput_error(run: PublishedRun, predicted: Plan) -> float:
    """Predicted / published throughput - 1 (the same FLOPs count on both sides, so it is a ratio of times)."""
    return run.seconds() / predicted.iteration_seconds - 1


def layout_rank(run: PublishedRun) -> tuple[int | None, float | None]:
    """Searching the run's model, GPU count and batch with its software and its recompute policy (when published):
    the rank (1 = best) of the published (tp, pp, dp) among the best plan of every decomposition, and its
    predicted time over the best's. (None, None) when the published layout does not fit the planner's
    memory model."""
    recompute = (run.layout["recompute"],) if run.layout.get("recompute") else None
    plans = search(
        run.model, run.gpus, GPUS_PER_NODE, run.gpu, run.global_batch,
        implementation=run.implementation, recompute_modes=recompute,
    )  # fmt: skip
    decompositions = best_per_layout(plans)
    key = (run.layout["tp"], 1, run.layout["pp"], run.layout["dp"], 1)  # the published runs use no CP, no EP
    for rank, p in enumerate(decompositions, start=1):
        if p.layout_key == key:
            return rank, p.iteration_seconds / decompositions[0].iteration_seconds
    return None, None  # the published layout does not fit the planner's memory model (it is conservative)


def validation_table(runs: list[PublishedRun], with_rank: bool = True) -> list[dict]:
    rows = []
    for run in runs:
        predicted = predict(run)
        published_tflops = flops_per_iteration(run.model, run.global_batch) / run.seconds() / run.gpus / 1e12
        row = {
            "name": run.name,
            "gpus": run.gpus,
            "layout": f"tp{run.layout['tp']} pp{run.layout['pp']} dp{run.layout['dp']}",
            "published_figure": UNITS[run.metric].format(run.value),
            "published_seconds": run.seconds(),
            "predicted_seconds": predicted.iteration_seconds,
            "published_model_tflops": published_tflops,
            "predicted_model_tflops": predicted.tflops_per_gpu,
            "error": throughput_error(run, predicted),
            "chosen": f"mb{predicted.micro_batch} v{predicted.virtual_stages} {predicted.recompute}"
            + (" sp" if predicted.sequence_parallel else ""),
        }
        if with_rank:
            row["rank"], row["vs_best"] = layout_rank(run)
        rows.append(row)
    return rows
