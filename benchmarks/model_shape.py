"""The GPT shape a benchmark measures, as command-line options with the benchmark's own defaults."""

from __future__ import annotations

import argparse

# SmolLM2-135M's shape (a real small model's: its depth and its 49k vocabulary's output layer are what a small random
# model leaves out); tied input and output embeddings.
SMOLLM2_135M = dict(layers=30, hidden=576, heads=9, kv_heads=3, ffn=1536, vocab=49152, rope_theta=100000.0)


def add_model_shape_args(
    parser: argparse.ArgumentParser,
    layers: int,
    hidden: int,
    heads: int,
    vocab: int | None = None,
    seq: int | None = None,
) -> None:
    """--layers, --hidden, --heads, and --vocab / --seq where the benchmark takes them (a default of None: not)."""
    parser.add_argument("--layers", type=int, default=layers, help=f"transformer layers (default {layers})")
    parser.add_argument("--hidden", type=int, default=hidden, help=f"hidden size (default {hidden})")
    parser.add_argument("--heads", type=int, default=heads, help=f"attention heads (default {heads})")
    if vocab is not None:
        parser.add_argument("--vocab", type=int, default=vocab, help=f"vocabulary (default {vocab})")
    if seq is not None:
        parser.add_argument("--seq", type=int, default=seq, help=f"sequence length (default {seq})")


def shape_fields(args: argparse.Namespace) -> dict:
    """The options of `add_model_shape_args` as `ModelConfig` fields (vocab_size and seq_len where taken)."""
    fields = {"num_layers": args.layers, "hidden_size": args.hidden, "num_heads": args.heads}
    if hasattr(args, "vocab"):
        fields["vocab_size"] = args.vocab
    if hasattr(args, "seq"):
        fields["seq_len"] = args.seq
    return fields


def shape_options(args: argparse.Namespace) -> list:
    """The options of `add_model_shape_args` as given, to pass on to a worker's command line."""
    options = ["--layers", args.layers, "--hidden", args.hidden, "--heads", args.heads]
    for name in ("vocab", "seq"):
        if hasattr(args, name):
            options += [f"--{name}", getattr(args, name)]
    return options
