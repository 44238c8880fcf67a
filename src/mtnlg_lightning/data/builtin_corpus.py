"""The offline demo corpus: English documentation text that ships with every Python install.

The docstrings of the Python standard library (~1.7 MB of real English prose about programming) are
extracted with `ast`, one document per module, then a 4096-token byte-level BPE is trained on them and the
corpus is tokenized. Everything is cached under MTNLG_CACHE (default ~/.cache/mtnlg_lightning); nothing is
downloaded.
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path

from mtnlg_lightning.corpora.storage import cache_root
from mtnlg_lightning.data.preprocess import preprocess_jsonl
from mtnlg_lightning.data.tokenizer import train_bpe
from mtnlg_lightning.outputs import atomic_write

SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "__pycache__"}
DEMO_VOCAB_SIZE = 4096


def demo_dir() -> Path:
    return cache_root() / f"python-docs-{sys.version_info.major}.{sys.version_info.minor}"


def stdlib_documents(min_chars: int = 40):
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


def build_demo_data(progress: bool = True) -> tuple[str, str]:
    """Return (dataset prefix, tokenizer path), building them once. Safe to call again: reuses the cache."""
    directory = demo_dir()
    prefix, tokenizer_path = directory / "python_docs", directory / "tokenizer.json"
    if (directory / "DONE").exists():
        return str(prefix), str(tokenizer_path)
    directory.mkdir(parents=True, exist_ok=True)
    documents = list(stdlib_documents())
    corpus = directory / "python_docs.jsonl"
    with atomic_write(corpus, "w") as f:
        for doc in documents:
            f.write(json.dumps(doc) + "\n")
    train_bpe((d["text"] for d in documents), DEMO_VOCAB_SIZE, tokenizer_path)
    summary = preprocess_jsonl(str(corpus), str(tokenizer_path), str(prefix), progress=progress)
    (directory / "DONE").write_text(str(summary) + "\n")
    print(f"built the demo corpus in {directory}: {summary}")
    return str(prefix), str(tokenizer_path)
