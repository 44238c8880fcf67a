"""Built-in corpora by name (`data.builtin_corpus`), found through the entry points of the group
`mtnlg_lightning.builtin_corpora`: each names a function `build(progress: bool) -> (dataset prefix, tokenizer
path)` that builds its corpus once and caches it. This package registers `python-docs`, the offline demo corpus of
`demo/` (pyproject.toml); another installed package can add its own. The trainer finds a corpus by its name and
never imports the demo part of the house.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from mtnlg_lightning.errors import MTNLGError

GROUP = "mtnlg_lightning.builtin_corpora"


def find_builtin_corpus(name: str) -> EntryPoint:
    """The entry point of the named corpus; an unknown name is one line listing the installed ones."""
    entries = {entry.name: entry for entry in entry_points(group=GROUP)}
    if name not in entries:
        available = ", ".join(repr(n) for n in sorted(entries))
        available = available or "none (mtnlg-lightning is not installed: pip install -e .)"
        raise MTNLGError(f"unknown builtin_corpus {name!r}; available: {available}")
    return entries[name]


def build_builtin_corpus(name: str, progress: bool = True) -> tuple[str, str]:
    """(dataset prefix, tokenizer path) of the named corpus, built on first use (then from its cache)."""
    return find_builtin_corpus(name).load()(progress=progress)
