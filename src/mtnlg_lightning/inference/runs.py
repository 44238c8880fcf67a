"""`mtnlg-eval` and `mtnlg-generate` in a layout (`--strategy`, `--devices`): checks, launch, load, run.

Everything that needs no weights is checked first, in the launching process (or on every rank under torchrun):
the strategy file, the checkpoint's manifest and its tensors' shapes against its model config, and the layout
against the model (heads, vocabulary, layers) and the world size. Only then are ranks started and slices read.
Only rank 0 prints results, writes files and reports errors.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.errors import MTNLGError, exit_status, one_line
from mtnlg_lightning.inference.launch import (
    InferenceLayout,
    check_layout,
    finish,
    init_distributed,
    is_rank_zero,
    launch_local,
    needs_launch,
    read_strategy,
    world_size_for,
)
from mtnlg_lightning.quick_exit import skip_final_garbage_collection


@dataclass
class Plan:
    path: Path
    manifest: dict
    config: ModelConfig
    layout: InferenceLayout
    grid: object  # ParallelLayout
    world_size: int


def plan(checkpoint: str, strategy: str | None, devices: int | None) -> Plan:
    """The checks that read no weights; the run's layout."""
    from mtnlg_lightning.checkpoint.format import is_checkpoint, read_manifest
    from mtnlg_lightning.inference.engine import check_checkpoint_shapes

    layout = read_strategy(strategy)
    world = world_size_for(devices)
    path = Path(checkpoint)
    if path.exists() and not is_checkpoint(path):
        raise MTNLGError(
            f"{path} is not a checkpoint folder of this project: a layout (--strategy/--devices) reads a sharded "
            f"checkpoint's slices; run a Hugging Face directory or a single file without them"
        )
    manifest = read_manifest(path)
    config = ModelConfig(**manifest["model_config"])
    check_checkpoint_shapes(manifest, config, path)
    grid = check_layout(layout, world, config)
    return Plan(path, manifest, config, layout, grid, world)


def load(plan_: Plan, device_arg: str, dtype_arg: str, decoding: bool = False):
    """(ShardedModel, tokenizer path or None) on this rank, after joining the world. `decoding`: without sequence
    parallelism (a decoding step's one position cannot be cut over TP; the weights are the same)."""
    import torch.distributed as dist

    from mtnlg_lightning.checkpoint.format import TOKENIZER
    from mtnlg_lightning.inference.engine import ShardedModel
    from mtnlg_lightning.inference.load import pick_dtype
    from mtnlg_lightning.parallel.layout import ProcessGroups

    device = init_distributed(device_arg)
    if dist.get_world_size() != plan_.world_size:
        raise MTNLGError(f"the world has {dist.get_world_size()} ranks, the layout needs {plan_.world_size}")
    groups = ProcessGroups.create(plan_.grid, backend=dist.get_backend())
    reader = SizeCheckedReader(plan_.path, plan_.manifest)
    model = ShardedModel.load(
        reader,
        plan_.config,
        groups,
        device,
        pick_dtype(dtype_arg, device),
        plan_.layout.pipeline,
        plan_.layout.sequence_parallel and not decoding,
    )
    tokenizer = plan_.path / TOKENIZER
    return model, (tokenizer if tokenizer.is_file() else None)


def _reader_base():
    from mtnlg_lightning.checkpoint.format import TensorReader

    return TensorReader


class SizeCheckedReader(_reader_base()):
    """A `TensorReader` that checks each file it opens against the manifest's size (cheap: a rank opens only the
    files holding its slices; checksumming them would read every byte of them on every rank)."""

    def _file(self, name: str):
        if name not in self._open:
            from mtnlg_lightning.checkpoint.format import CheckpointError

            expected = self.manifest["files"][name]["size"]
            file = self.path / name
            size = file.stat().st_size if file.is_file() else None
            if size != expected:
                found = "missing" if size is None else f"{size} bytes"
                raise CheckpointError(f"checkpoint file {file} is {found}, the manifest says {expected} bytes")
        return super()._file(name)


def command_main(prog: str, parser, run_one_process, run_in_layout, argv: list[str] | None) -> int:
    """`mtnlg-eval` / `mtnlg-generate`: in a layout with --strategy or --devices, else in this process (a bad
    input is one line and exit status 2)."""
    skip_final_garbage_collection()  # quick_exit.py: a quicker exit
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.strategy or args.devices:
        return run_in_layout(args, argv)
    return exit_status(prog, lambda: run_one_process(args))


def _fail(prog: str, error: Exception) -> int:
    if is_rank_zero():
        print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
    return 2


# ------------------------------------------------------------------------------------------- mtnlg-eval
def run_eval(args, argv: list[str]) -> int:
    from mtnlg_lightning.evaluation import evaluate as evaluation_run

    try:
        evaluation_run.check_args(args)
        plan_ = plan(args.checkpoint, args.strategy, args.devices)
        if needs_launch(plan_.world_size):
            return launch_local("mtnlg_lightning.evaluation.cli", argv, plan_.world_size)
        model, tokenizer_path = load(plan_, args.device, args.dtype)
        payload = evaluate(model, plan_, args, tokenizer_path)
        if is_rank_zero():
            evaluation_run.report(args, payload)
    except MTNLGError as error:
        return _fail("mtnlg-eval", error)
    finally:
        finish()
    return 0


def evaluate(model, plan_: Plan, args, tokenizer_path) -> dict:
    """The task's (or the harness tasks') results on every rank, with the settings and layout."""
    from mtnlg_lightning.evaluation import evaluate as evaluation_run
    from mtnlg_lightning.inference.load import resolve_tokenizer
    from mtnlg_lightning.inference.scoring import PipelineScorer

    tokenizer = resolve_tokenizer(tokenizer_path, args.tokenizer)
    started = time.perf_counter()
    results = evaluation_run.evaluate(
        args,
        model,
        tokenizer,
        lambda: PipelineScorer(model, args.batch_size, args.micro_batch_size, progress=not args.no_progress),
    )
    seconds = time.perf_counter() - started
    settings = evaluation_run.settings_of(args)
    settings["layout"] = plan_.layout.describe(plan_.world_size)
    return {"results": results, "settings": settings, "seconds": seconds, "stage_busy_fraction": busy_by_rank(model)}


def busy_by_rank(model) -> list[float]:
    """Per rank, the fraction of its forward passes' time spent computing its stages (the rest: waiting for a
    previous stage's activations or TP peers): how well the pipeline is kept fed."""
    import torch.distributed as dist

    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, (model.times.busy, model.times.wall))
    return [round(busy / wall, 4) if wall else 0.0 for busy, wall in times]


# ------------------------------------------------------------------------------------------- mtnlg-generate
def run_generate(args, argv: list[str]) -> int:
    try:
        if args.max_new_tokens < 1 or args.num_samples < 1:
            raise MTNLGError("--max-new-tokens and --num-samples must be at least 1")
        plan_ = plan(args.checkpoint, args.strategy, args.devices)
        prompts = read_prompts(args.prompt)
        if needs_launch(plan_.world_size):
            return _launch_with_prompts("mtnlg_lightning.generate", argv, plan_.world_size, prompts, args.prompt)
        model, tokenizer_path = load(plan_, args.device, args.dtype, decoding=True)
        generate_and_print(model, args, prompts, tokenizer_path)
    except MTNLGError as error:
        return _fail("mtnlg-generate", error)
    finally:
        finish()
    return 0


PROMPTS_ENV = "MTNLG_GENERATE_PROMPTS"


def read_prompts(prompt: str) -> list[str]:
    """The prompts: `--prompt TEXT`, or the non-empty lines of stdin (`-`; UTF-8, else one line); ranks started by
    `--devices` cannot share the launcher's stdin, so it hands them the lines it read (as JSON in an environment
    variable)."""
    import json
    import os

    if prompt != "-":
        return [prompt]
    if PROMPTS_ENV in os.environ:
        return json.loads(os.environ[PROMPTS_ENV])
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise MTNLGError(f"stdin is not UTF-8 text (byte {error.start} is {data[error.start]:#04x})") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise MTNLGError("--prompt -: stdin holds no prompt (one a line)")
    return prompts


def _launch_with_prompts(module: str, argv: list[str], world_size: int, prompts: list[str], prompt: str) -> int:
    """The ranks inherit the prompts read from stdin (set only for the launch: nothing stays in this process)."""
    import json
    import os

    if prompt != "-":
        return launch_local(module, argv, world_size)
    os.environ[PROMPTS_ENV] = json.dumps(prompts)
    try:
        return launch_local(module, argv, world_size)
    finally:
        os.environ.pop(PROMPTS_ENV, None)


def generate_and_print(model, args, prompts: list[str], tokenizer_path) -> None:
    from mtnlg_lightning.inference.generation import generate_over_replicas
    from mtnlg_lightning.inference.load import resolve_tokenizer

    tokenizer = resolve_tokenizer(tokenizer_path, args.tokenizer)
    batch = [tokenizer.encode(p) for p in prompts for _ in range(args.num_samples)]
    result = generate_over_replicas(
        model,
        batch,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=tokenizer.eod_id,
        seed=args.seed,
    )
    if not is_rank_zero():
        return
    for n, tokens in enumerate(result.tokens):
        prompt = prompts[n // args.num_samples]
        print(f"--- prompt {n // args.num_samples + 1} sample {n % args.num_samples + 1} ---")
        print(prompt + tokenizer.decode(tokens))
    made = sum(len(t) for t in result.tokens)
    layout = model.layout
    print(
        f"mtnlg-generate: {made} tokens for {len(prompts)} prompt(s) in {result.seconds:.2f} s "
        f"({made / max(result.seconds, 1e-9):.1f} tokens/s) on {layout.world_size} rank(s) "
        f"(tp {layout.tensor_parallel} x pp {layout.pipeline_parallel} x dp {layout.data_parallel}), "
        f"{str(model.dtype)[6:]}",
        file=sys.stderr,
    )
