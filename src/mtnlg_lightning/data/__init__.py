from mtnlg_lightning.data.datamodule import GPTDataModule

__all__ = ["GPTDataModule"]
