"""`mtnlg`: the LightningCLI entry point (fit / validate / test / predict)."""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

from mtnlg_lightning.data.datamodule import GPTDataModule
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.module import MTNLGModule


class MTNLGCLI(LightningCLI):
    def before_instantiate_classes(self) -> None:
        """`trainer.precision: null` picks the fastest correct precision for the machine: bf16-mixed on a GPU (as
        MT-NLG trained), 32-true on a CPU, where bf16 autocast is slower than fp32 (~1.7x on the demo)."""
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        if config is not None and config.trainer.precision is None:
            config.trainer.precision = default_precision()


def default_precision() -> str:
    import torch

    return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"


def _wandb_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.expanduser("~/.netrc")
    return os.path.exists(netrc) and "api.wandb.ai" in open(netrc, encoding="utf-8", errors="ignore").read()


def main(args: list[str] | None = None) -> None:
    if "WANDB_MODE" not in os.environ and not _wandb_configured():
        os.environ["WANDB_MODE"] = "offline"  # no credentials (or no network): keep the run locally
    try:
        MTNLGCLI(MTNLGModule, GPTDataModule, save_config_kwargs={"overwrite": True}, args=args)
    except MTNLGError as error:
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        if getattr(rank_zero_only, "rank", 0) == 0:  # every rank fails alike: one message, from rank 0
            print(f"mtnlg: error: {error}", file=sys.stderr)
        sys.exit(2)
    _destroy_process_group()


def _destroy_process_group() -> None:
    """Leave no communication threads to the interpreter's exit (they can abort an otherwise finished run)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
