"""The callback config fragments under callbacks/ load from the CLI (LightningCLI / jsonargparse syntax)."""

from __future__ import annotations

from pathlib import Path

from mtnlg_lightning.callbacks import ActivationCheckpointing, LossSpikeDetection
from mtnlg_lightning.data.datamodule import GPTDataModule
from mtnlg_lightning.train.cli import MTNLGCLI
from mtnlg_lightning.train.module import MTNLGModule

ROOT = Path(__file__).resolve().parents[1]


def test_fragments_append_to_trainer_callbacks_and_accept_overrides():
    cli = MTNLGCLI(
        MTNLGModule,
        GPTDataModule,
        run=False,
        save_config_callback=None,
        args=[
            "--config",
            str(ROOT / "configs" / "tiny.yaml"),
            f"--trainer.callbacks+={ROOT / 'callbacks' / 'loss_spike.yaml'}",
            "--trainer.callbacks.init_args.action=rewind",  # applies to the callback appended last
            f"--trainer.callbacks+={ROOT / 'callbacks' / 'activation_checkpointing.yaml'}",
            "--trainer.callbacks.init_args.mode=full",
        ],
    )
    spike = next(cb for cb in cli.trainer.callbacks if isinstance(cb, LossSpikeDetection))
    ckpt = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ActivationCheckpointing))
    assert spike.action == "rewind" and spike.detector.window == 100 and spike.detector.threshold == 6.0
    assert ckpt.mode == "full"
