"""What the frameworks print at a run of this trainer that means nothing here, silenced in one place.

`mtnlg` (`train/cli.py`) calls `quiet_known_noise()` first, builds its Trainer with `trainer_arguments` (the model
summary without its unmeasured FLOPs) and `quiet_trainer`, and calls `quiet_resume` once it knows the checkpoint it
resumes from. Each message is matched by its own words (and where it comes from), beside the reason it means nothing
here; anything else the frameworks say still prints. `tests/test_finetune_cli.py` checks that a fine-tuning run
prints none of them. Still said: wandb's "The anonymous setting has no effect" (Lightning's WandbLogger passes
`anonymous=None` to `wandb.init`, which warns at any value, and no public setting leaves it out).
"""

from __future__ import annotations

import logging
import os
import re
import warnings

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count

# (message, category, the module that warns): each a regular expression matched from the start.
KNOWN_WARNINGS = (
    # Every data module's loader is `data/datamodule.py` `StepBatches`, an IterableDataset whose `__len__` (the
    # steps of the split) is exact with any number of workers: worker w yields steps w, w + W, ... and the
    # DataLoader takes them in turn, so no worker repeats another's data.
    (r"Your `IterableDataset` has `__len__` defined", UserWarning, r"lightning\.pytorch\.utilities\.data"),
    # A run without validation (or test) records: the data module returns an empty list of loaders
    # (`StepDataModule._eval_dataloader`), and nothing to validate is what was asked. A split too small for one
    # global batch is still said: its loader is a `DataLoader`, not a `list`.
    (r"Total length of `list` across ranks is zero\.", UserWarning, r"lightning\.pytorch\.utilities\.data"),
    # A resume mid-split (every resume: a run is one pass over its split): the loader is rebuilt to start at the
    # checkpoint's consumed samples (`StepDataModule.train_dataloader`, `TrainingPosition`), so the data goes on
    # where it stopped (`tests/test_checkpoints.py`: a resumed run's losses are bit-identical to an unbroken one's).
    (
        r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable",
        UserWarning,
        r"lightning\.pytorch\.loops\.training_epoch_loop",
    ),
    # Under Lightning's mixed precision the weights are fp32 (bf16 or fp16 only inside autocast), so the summary's
    # 32 bits a weight is their size (under ZeRO, that of their fp32 master copy).
    (
        r"Precision (bf16|16)-mixed is not supported by the model summary\.",
        UserWarning,
        r"lightning\.pytorch\.utilities\.model_summary",
    ),
    # Lightning's own loader code (`CombinedLoader`) builds torch's deprecated `LeafSpec`: nothing a config or this
    # trainer can change; it goes when Lightning stops using it.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
    # torch 2.12+ renamed two collectives; this trainer calls the new names where torch has them
    # (`parallel/sequence_parallel.py`): the old ones come from DeepSpeed's ZeRO (0.19), nothing a run can change.
    (
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated\.",
        FutureWarning,
        r"torch\.distributed\.c10d_logger",
    ),
)

# Lightning's info lines (logger `lightning.pytorch.utilities.rank_zero`) advertising its cloud products: runs log to
# wandb or CSV as their config says, and checkpoints are this project's layout-independent folders
# (`checkpoint/callback.py`), which LitModelCheckpoint does not write.
KNOWN_INFO = re.compile(
    r"💡 Tip: For seamless cloud (logging and experiment tracking|uploads and versioning), "
    r"try installing \[lit(logger|models)\]"
)
RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"


class _DropKnownInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not KNOWN_INFO.match(record.getMessage())


_DROP_KNOWN_INFO = _DropKnownInfo()


def quiet_known_noise() -> None:
    """Install the filters (again is harmless: a filter is added once)."""
    for message, category, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    logging.getLogger(RANK_ZERO_LOGGER).addFilter(_DROP_KNOWN_INFO)


class ModelSummaryWithoutFlops(ModelSummary):
    """Lightning's model summary without its FLOPs column and "Total FLOPs" line: Lightning measures FLOPs only by
    running the module's `example_input_array`, which this module has not (a whole forward on one rank is what a
    sharded layout avoids), so they read 0. The step's FLOPs are counted by `train/flops.py` (MFU in the metrics)."""

    @staticmethod
    def summarize(
        summary_data,
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs,
    ) -> None:
        if total_flops:  # measured after all: Lightning's own summary says it
            ModelSummary.summarize(
                summary_data,
                total_parameters,
                trainable_parameters,
                model_size,
                total_training_modes,
                total_flops,
                **summarize_kwargs,
            )
            return
        columns = [(name, [str(value) for value in values]) for name, values in summary_data if name != "FLOPs"]
        header = [name for name, _ in columns]
        rows = list(zip(*(values for _, values in columns), strict=True))
        totals = [
            ("Trainable params", get_human_readable_count(trainable_parameters)),
            ("Non-trainable params", get_human_readable_count(total_parameters - trainable_parameters)),
            ("Total params", get_human_readable_count(total_parameters)),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", str(total_training_modes["train"])),
            ("Modules in eval mode", str(total_training_modes["eval"])),
        ]
        try:
            from rich import get_console
            from rich.table import Table
        except ImportError:  # Lightning's plain table, as its ModelSummary prints it where rich is not installed
            widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
            lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
            rule = "-" * (sum(widths) + 3 * len(widths))
            head = " | ".join(name.ljust(width) for name, width in zip(header, widths, strict=True))
            print("\n".join([head, rule, *lines, rule, *(f"{value:<10}{name}" for name, value in totals)]))
            return
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for index, name in enumerate(header):
            numeric = name.startswith("Params") or name.endswith("sizes")
            table.add_column(name, justify="right" if numeric else "left", style="dim" if index == 0 else None)
        for row in rows:
            table.add_row(*row)
        grid = Table.grid(expand=True)
        grid.add_column()
        for name, value in totals:
            grid.add_row(f"[bold]{name}[/]: {value}")
        console = get_console()
        console.print(table)
        console.print(grid)


def trainer_arguments(trainer_config: dict) -> dict:
    """Trainer arguments that put `ModelSummaryWithoutFlops` in the place of Lightning's default summary; none where
    the run has no summary or names its own summary callback."""
    callbacks = trainer_config.get("callbacks")
    callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    if trainer_config.get("enable_model_summary") is False or trainer_config.get("barebones"):
        return {}
    if any(isinstance(callback, ModelSummary) for callback in callbacks):
        return {}
    return {"enable_model_summary": False, "callbacks": [*callbacks, ModelSummaryWithoutFlops()]}


def quiet_trainer(trainer) -> None:
    """wandb's "git root runs/X does not exist" at the start of a run of the shipped configs: wandb looks for the git
    repository from the logger's `save_dir` before it makes that folder (and then records no commit). Made here
    first, wandb finds the repository, if there is one, and says nothing."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and logger.save_dir and trainer.is_global_zero:
            os.makedirs(logger.save_dir, exist_ok=True)


def quiet_resume(ckpt_path: str | None) -> None:
    """A resume from a checkpoint of folder X: Lightning's ModelCheckpoint says "Checkpoint directory X exists and is
    not empty", and going on writing where the run wrote is what a resume does. A run that starts fresh in a used
    folder, or resumes from another folder, is still told."""
    if not ckpt_path:
        return
    path = str(ckpt_path)
    folder = path.rstrip("/").rsplit("/", 1)[0] if "://" in path else os.path.dirname(os.path.realpath(path))
    warnings.filterwarnings(
        "ignore",
        message=rf"Checkpoint directory {re.escape(folder)} exists and is not empty\.",
        category=UserWarning,
        module=r"lightning\.pytorch\.callbacks\.model_checkpoint",
    )
