"""Built-in corpora by name (`data.builtin_corpus`), found through the entry points of the group
`mtnlg_lightning.builtin_corpora`: each names a function `build(progress: bool) -> (dataset prefix, tokenizer
path)` that builds its corpus once and caches it. This package registers `python-docs`, the offline demo corpus of
`demo/` (pyproject.toml); another installed package can add its own. The trainer finds a corpus by its name and
never imports the demo part of the house.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from mtnlg_lightning.errors import MTNLGError

GROUP = "mtnlg_lightning.builtin_corpora"


def builtin_corpus_names() -> list[str]:
    return sorted({entry.name for entry in entry_points(group=GROUP)})


def check_builtin_corpus(name: str) -> None:
    names = builtin_corpus_names()
    if name not in names:
        available = ", ".join(repr(n) for n in names) or "none (mtnlg-lightning is not installed: pip install -e .)"
        raise MTNLGError(f"unknown builtin_corpus {name!r}; available: {available}")


def build_builtin_corpus(name: str, progress: bool = True) -> tuple[str, str]:
    """(dataset prefix, tokenizer path) of the named corpus, built on first use (then from its cache)."""
    check_builtin_corpus(name)
    entry = next(entry for entry in entry_points(group=GROUP) if entry.name == name)
    return entry.load()(progress=progress)
