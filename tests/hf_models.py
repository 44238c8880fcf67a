"""Local stand-ins for downloaded models, built offline: a vocabulary-1000 BPE, a random GPT-2 directory (3 layers,
4 heads, vocabulary not a multiple of 128). The tiny runs the session trains are in tiny_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mtnlg_lightning.data.builtin_corpus import build_demo_data, demo_dir
from mtnlg_lightning.data.tokenizer import Tokenizer, train_bpe

RANDOM_GPT2 = dict(vocab_size=1000, n_positions=64, n_embd=64, n_layer=3, n_head=4)


def demo_texts(count: int) -> list[str]:
    build_demo_data(progress=False)
    with open(demo_dir() / "python_docs.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f.readlines()[:count]]


def small_tokenizer(directory: Path) -> Tokenizer:
    tokenizer = train_bpe(demo_texts(200), RANDOM_GPT2["vocab_size"], directory)
    assert tokenizer.vocab_size == RANDOM_GPT2["vocab_size"]
    return tokenizer


def random_gpt2_dir(directory: Path, seed: int = 0) -> Path:
    """A random `GPT2LMHeadModel` saved with `save_pretrained`, plus its tokenizer.json. Every tensor (biases and
    LayerNorms included) is perturbed so a mapping mistake anywhere changes the logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = small_tokenizer(directory / "tokenizer")
    torch.manual_seed(seed)
    config = GPT2Config(
        **RANDOM_GPT2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eod_id,
        eos_token_id=tokenizer.eod_id,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    out = directory / "gpt2-random"
    model.save_pretrained(out)
    tokenizer.save(out / "tokenizer.json")
    return out
