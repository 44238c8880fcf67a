import importlib

# The data modules import Lightning (~8 s on a 2-core machine); the preprocessing and tokenizer tools import this
# package without needing it, so they are loaded on first use instead of here.
__all__ = ["FineTuneDataModule", "GPTDataModule"]

_MODULES = {"GPTDataModule": "datamodule", "FineTuneDataModule": "finetune"}


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
