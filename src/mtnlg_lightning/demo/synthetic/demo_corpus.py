"""The demo corpus' documents: English documentation text that ships with every Python install.

The docstrings of the Python standard library (~1.7 MB of real English prose about programming) are extracted
with `ast`, one document per module. `demo/builtin_corpus.py` trains the demo tokenizer on them and tokenizes them
(`data.builtin_corpus: python-docs`); the pipeline's planted corpus cuts them into web pages. Everything is cached
under MTNLG_CACHE (default ~/.cache/mtnlg_lightning); nothing is downloaded.
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path

from mtnlg_lightning.corpora.storage import cache_root
from mtnlg_lightning.outputs import atomic_write

SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "__pycache__"}
DOCUMENTS_NAME = "python_docs.jsonl"


def demo_dir() -> Path:
    """The cache folder of the demo corpus for this Python version."""
    return cache_root() / f"python-docs-{sys.version_info.major}.{sys.version_info.minor}"


def stdlib_documents(min_chars: int = 40):
    """One {"id": module path, "text": its docstrings} per module of the standard library (tests left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_DIRS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = (
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        )
        parts = [doc for doc in (ast.get_docstring(n) for n in nodes) if doc and len(doc) >= min_chars]
        if parts:
            yield {"id": str(path.relative_to(root)), "text": "\n\n".join(parts)}


def write_documents(path: Path) -> list[dict]:
    """The standard library's documents as JSON lines at `path` (atomically); returns them."""
    documents = list(stdlib_documents())
    with atomic_write(path, "w") as f:
        for doc in documents:
            f.write(json.dumps(doc) + "\n")
    return documents


def demo_documents() -> list[dict]:
    """The demo corpus' module documents (read from the demo cache when it is built, else extracted)."""
    cached = demo_dir() / DOCUMENTS_NAME
    if cached.exists():
        with open(cached, encoding="utf-8") as f:
            return [json.loads(line) for line in f]
    return list(stdlib_documents())
