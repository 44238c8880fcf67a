# GPTDataModule imports Lightning (~8 s on a 2-core machine); the preprocessing and tokenizer tools import this
# package without needing it, so it is loaded on first use instead of here.
__all__ = ["GPTDataModule"]


def __getattr__(name: str):
    if name == "GPTDataModule":
        from mtnlg_lightning.data.datamodule import GPTDataModule

        return GPTDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
