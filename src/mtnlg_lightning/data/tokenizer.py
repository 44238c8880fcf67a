"""GPT-2-style byte-level BPE through HF `tokenizers`. Files come from the user: a path, or a URL of the user's own
store (fetched into the cache, by version); nothing is downloaded from anywhere else."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.corpora.commit import output_file
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.outputs import atomic_path

EOD_TOKEN = "<|endoftext|>"
# The end-of-document token, by the first of these a tokenizer has: GPT-2's (and Qwen's), Llama 3's, Llama 2's.
EOD_TOKENS = (EOD_TOKEN, "<|end_of_text|>", "</s>")


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer`; `eod_id` is the end-of-document token appended after every document."""

    def __init__(self, path: str | os.PathLike):
        path = Path(local_tokenizer(os.fspath(path)))
        try:
            if path.is_dir() and (path / "tokenizer.json").exists():
                path = path / "tokenizer.json"
            if path.is_file():
                self._tok = HFTokenizer.from_file(str(path))
            elif path.is_dir() and (path / "vocab.json").exists() and (path / "merges.txt").exists():
                self._tok = HFTokenizer(BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt")))
                self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
                self._tok.decoder = decoders.ByteLevel()
            else:
                raise MTNLGError(
                    f"no tokenizer at {path}: give a tokenizer.json file, or a directory holding tokenizer.json "
                    f"or vocab.json + merges.txt (train one with mtnlg-train-tokenizer)"
                )
        except MTNLGError:
            raise
        except Exception as error:  # tokenizers raises plain Exceptions on malformed files
            raise MTNLGError(f"cannot load tokenizer {path}: {error}") from None
        found = [token for token in EOD_TOKENS if self._tok.token_to_id(token) is not None]
        if not found:
            raise MTNLGError(f"tokenizer {path} has none of {', '.join(EOD_TOKENS)} (needed as end-of-document)")
        self.eod_token = found[0]
        self.eod_id = self._tok.token_to_id(self.eod_token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write it as one `tokenizer.json` (whatever files it was read from)."""
        self._tok.save(str(path))


def train_bpe(texts, vocab_size: int, output: str | os.PathLike, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style, with <|endoftext|>) on an iterator of texts; write
    tokenizer.json atomically."""
    tok = HFTokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    output = os.fspath(output)
    if not output.endswith(".json"):
        output = storage.join(output, "tokenizer.json")
    with output_file(output) as local, atomic_path(local) as tmp:
        tok.save(tmp)
        trained = Tokenizer(tmp)
    return trained


TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))


def local_tokenizer(path: str) -> str:
    """``path`` itself, or for a URL (a tokenizer.json, or a prefix holding tokenizer.json or vocab.json +
    merges.txt) a local copy in the cache, fetched again only when the remote file changes."""
    if not storage.is_url(path):
        return path
    if not storage.info(path).is_dir:
        files = {storage.basename(path): path}
    else:
        for names in TOKENIZER_FILES:
            urls = {n: storage.join(path, n) for n in names}
            if all(storage.exists(u) for u in urls.values()):
                files = urls
                break
        else:
            raise MTNLGError(f"no tokenizer at {path}: it holds neither tokenizer.json nor vocab.json + merges.txt")
    versions = "|".join(f"{u}@{storage.info(u).version}" for u in files.values())
    local = storage.cache_root() / "tokenizers" / hashlib.sha256(versions.encode()).hexdigest()[:16]
    for name, url in files.items():
        if not (local / name).exists():
            storage.download(url, str(local / name))
    return str(local / next(iter(files))) if len(files) == 1 else str(local)
