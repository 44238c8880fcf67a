"""Today's dense families (and long sequences) in the layouts, one torchrun launch per world size.

    MTNLG_TEST_FAMILY_DIRS='{"llama": DIR, "qwen3": DIR}' torchrun --standalone --nproc-per-node 4 \\
        tests/dist_family_runs.py OUT_DIR llama_tp4 qwen3_tp4 llama_tp2_dp2_zero3_sp ...

A run is FAMILY_LAYOUT: FAMILY a random Hugging Face directory the test made (`--model.init_from`) or `gpt` (the
tiny preset), LAYOUT the strategy spelled like tp2, pp2, cp2, tp2_pp2_dp2_zero1, ep2 (a mixture of experts' experts
over 2 of the DP ranks), with _sp for sequence parallelism, _interleaved for the interleaved 1F1B schedule (4
blocks), _acfull for full activation checkpointing (DP is what is left); context-parallel runs train on sequences of
256 tokens. Suffixes: _ckpt trains 6 steps saving at 3 and 6; _from_LAYOUT resumes that layout's step-3 checkpoint
(in OUT_DIR or MTNLG_TEST_FROM_DIR). `eval_FAMILY_LAYOUT` evaluates the step-6 checkpoint of FAMILY_LAYOUT_ckpt with
`mtnlg-eval` in that layout. Rank 0 writes OUT_DIR/NAME.pt for pytest (losses, grad norms, parameters at step 5).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: testing.*
from mtnlg_lightning.callbacks import ActivationCheckpointing  # noqa: E402
from mtnlg_lightning.train.strategy import MegatronDeepSpeedStrategy  # noqa: E402
from testing.parallel_harness import run_each, run_script, tiny_run  # noqa: E402

FAMILY_DIRS = json.loads(os.environ.get("MTNLG_TEST_FAMILY_DIRS", "{}"))  # gpt: the tiny preset, no directory
LONG = 256  # the sequence length of the context-parallel runs
EVAL_TEXT = "def add(a, b):\n    return a + b\n\nThe value is returned to the caller of the function.\n" * 30


def layout_kwargs(layout: str) -> dict:
    """The strategy arguments a layout name spells."""
    kwargs = {"tensor_parallel": 1, "pipeline_parallel": 1, "zero_stage": 0}
    keys = {"tp": "tensor_parallel", "pp": "pipeline_parallel", "cp": "context_parallel", "zero": "zero_stage"}
    keys["ep"] = "expert_parallel"  # a mixture of experts' experts over EP of the data-parallel ranks
    for part in layout.split("_"):
        key = part.rstrip("0123456789")
        if key in keys:
            kwargs[keys[key]] = int(part[len(key) :])
    if "sp" in layout.split("_"):
        kwargs["sequence_parallel"] = True
    if "interleaved" in layout.split("_"):
        kwargs["pipeline_schedule"] = "interleaved_1f1b"
    return kwargs


def strategy_of(layout: str) -> tuple[MegatronDeepSpeedStrategy, int]:
    """The strategy of a layout name and its micro-batch size (pipelines need several micro-batches)."""
    kwargs = layout_kwargs(layout)
    if kwargs["zero_stage"] == 3:
        kwargs["deepspeed_config"] = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    micro_batch = 2 if kwargs["pipeline_parallel"] > 1 else 4
    return MegatronDeepSpeedStrategy(**kwargs, print_layout=False), micro_batch


def layout_options(layout: str) -> dict:
    """The `tiny_run` arguments a layout name adds: sequences of LONG tokens under context parallelism, full
    activation checkpointing (_acfull), 4 blocks for the interleaved pipeline (2 virtual stages per rank)."""
    parts = layout.split("_")
    options = {}
    if any(part.startswith("cp") for part in parts):
        options["seq_len"] = LONG
    if "acfull" in parts:
        options["callbacks"] = [ActivationCheckpointing(mode="full")]
    if "interleaved" in parts:
        options["model_overrides"] = {"num_layers": 4}
    return options


def checkpoints(out: Path, family: str, layout: str) -> Path:
    return out / f"{family}_{layout}_ckpt"


def train(name: str, out: Path, world: int) -> dict:
    family, layout = name.split("_", 1)
    extra = {}
    if layout.endswith("_ckpt"):
        layout = layout.removesuffix("_ckpt")
        strategy, micro_batch = strategy_of(layout)
        extra = dict(max_steps=6, capture_steps=(5, 6), checkpoint_dir=checkpoints(out, family, layout))
    elif "_from_" in layout:
        layout, source = layout.split("_from_")
        strategy, micro_batch = strategy_of(layout)
        origin = Path(os.environ.get("MTNLG_TEST_FROM_DIR") or out)
        extra = dict(max_steps=6, capture_steps=(6,), ckpt_path=checkpoints(origin, family, source) / "step=3.ckpt")
    else:
        strategy, micro_batch = strategy_of(layout)
    extra |= layout_options(layout)
    parts = layout.split("_")
    if "downstream" in parts:  # DownstreamEval scores a long document in the training layout after step 2
        evaluation = downstream_eval(out)
        extra |= {"callbacks": [evaluation], "max_steps": 2}
    source = FAMILY_DIRS.get(family)
    rec, _ = tiny_run(strategy, devices=world, micro_batch_size=micro_batch, init_from=source, **extra)
    found = {"losses": rec.losses, "grad_norms": rec.grad_norms, "lrs": rec.lrs, "params": rec.params}
    return found | ({"downstream": evaluation.last} if "downstream" in parts else {})


def downstream_eval(out: Path):
    """`DownstreamEval` of the perplexity of EVAL_TEXT (longer than the model's positions) every 2 steps."""
    from mtnlg_lightning.demo.builtin_corpus import build_demo_data
    from mtnlg_lightning.evaluation.callback import DownstreamEval

    text = out / "downstream_text.txt"
    if int(os.environ.get("RANK", "0")) == 0:  # read after the first steps, which every rank has to sync
        text.write_text(EVAL_TEXT)
    tokenizer = build_demo_data(progress=False)[1]
    return DownstreamEval(task="perplexity", data=str(text), tokenizer=tokenizer, every_n_steps=2)


def evaluate(name: str, out: Path) -> dict:
    """`mtnlg-eval --strategy` of FAMILY_LAYOUT_ckpt's step-6 checkpoint, in-process on every rank (the launch's
    world is the layout's), perplexity of a text longer than the model's positions (windows, stride 128)."""
    from mtnlg_lightning.evaluation.cli import main as eval_main

    family, layout = name.removeprefix("eval_").split("_", 1)
    text = out / "eval_text.txt"
    if dist.get_rank() == 0:
        text.write_text(EVAL_TEXT)
    dist.barrier()
    strategy = out / f"{layout}.yaml"
    if dist.get_rank() == 0:
        kwargs = layout_kwargs(layout)
        parallel = ("tensor_parallel", "pipeline_parallel", "context_parallel")
        args = "{" + ", ".join(f"{k}: {kwargs.get(k, 1)}" for k in parallel) + "}"
        strategy.write_text(f"class_path: mtnlg_lightning.strategy.MegatronDeepSpeedStrategy\ninit_args: {args}\n")
    dist.barrier()
    result = out / f"{name}.json"
    argv = ["--checkpoint", str(checkpoints(out, family, layout) / "step=6.ckpt"), "--strategy", str(strategy)]
    argv += ["--task", "perplexity", "--data", str(text), "--stride", "128", "--dtype", "fp32", "--no-progress"]
    argv += ["--output", str(result)]
    assert eval_main(argv) == 0
    return {}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    world = int(os.environ["WORLD_SIZE"])
    run_each(
        "dist_family_runs",
        sys.argv[2:],
        out,
        lambda name: evaluate(name, out) if name.startswith("eval_") else train(name, out, world),
    )


if __name__ == "__main__":
    run_script(main)
