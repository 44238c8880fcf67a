"""A benchmark's command line and where its figures go: `--json PATH`, written atomically so a killed run leaves no
half-written file."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

try:
    import mtnlg_lightning  # noqa: F401
except ImportError:  # a benchmark run from a plain checkout: the package is in ../src
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from mtnlg_lightning.outputs import write_json  # noqa: E402


def write_result(path: str | os.PathLike | None, result: Any, **dump_options) -> None:
    """The benchmark's figures as JSON at `path` (indent 1 unless `dump_options` say otherwise); no path, no file."""
    if path:
        write_json(path, result, **dump_options)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None where either is missing or zero (a run that did not measure it)."""
    return a / b if a and b else None


def trl_training_args(output_dir: str, steps: int, lr: float, weight_decay: float, betas, seed: int) -> dict:
    """The transformers TrainingArguments every TRL run of the benchmarks shares with ours: `steps` optimizer steps of
    one micro-batch each, a constant lr, AdamW with `betas` and `weight_decay`, clipping at 1.0, fp32, no saving,
    no progress bar, no loader workers."""
    return dict(
        output_dir=output_dir, max_steps=steps, gradient_accumulation_steps=1, learning_rate=lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=weight_decay, adam_beta1=betas[0],
        adam_beta2=betas[1], max_grad_norm=1.0, bf16=False, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=seed,
    )  # fmt: skip


def report(result: dict, json_path, print_table) -> int:
    """Print the run's table, write its JSON (`--json`), exit 0."""
    print_table(result)
    write_result(json_path, result)
    return 0


def benchmark_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser: its module docstring, as written, for the description."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_rounds_arg(parser: argparse.ArgumentParser, default: int, flag: str = "--rounds", what: str = "") -> None:
    """How many times the compared runs alternate (their medians are compared)."""
    parser.add_argument(
        flag, type=int, default=default, help=f"alternating rounds{what}; medians are compared (default {default})"
    )


def benchmark_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with --json (where `write_result` writes the figures) last."""
    parser.add_argument("--json", help="also write the figures to this JSON file")
    return parser.parse_args(argv)
