"""The offline demo dataset (`data.builtin_corpus: python-docs`): the demo corpus tokenized.

The documents are the Python standard library's docstrings (`demo/synthetic/demo_corpus.py`); a 4096-token byte-level
BPE is trained on them and the corpus is tokenized. Everything is cached under MTNLG_CACHE (default
~/.cache/mtnlg_lightning); nothing is downloaded.
"""

from __future__ import annotations

from mtnlg_lightning.data.preprocess import preprocess_jsonl
from mtnlg_lightning.data.tokenizer import train_bpe
from mtnlg_lightning.demo.synthetic.demo_corpus import DOCUMENTS_NAME, demo_dir, write_documents

DEMO_VOCAB_SIZE = 4096


def build_demo_data(progress: bool = True) -> tuple[str, str]:
    """Return (dataset prefix, tokenizer path), building them once. Safe to call again: reuses the cache."""
    directory = demo_dir()
    prefix, tokenizer_path = directory / "python_docs", directory / "tokenizer.json"
    if (directory / "DONE").exists():
        return str(prefix), str(tokenizer_path)
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / DOCUMENTS_NAME
    documents = write_documents(corpus)
    train_bpe((d["text"] for d in documents), DEMO_VOCAB_SIZE, tokenizer_path)
    summary = preprocess_jsonl(str(corpus), str(tokenizer_path), str(prefix), progress=progress)
    (directory / "DONE").write_text(str(summary) + "\n")
    print(f"built the demo corpus in {directory}: {summary}")
    return str(prefix), str(tokenizer_path)
