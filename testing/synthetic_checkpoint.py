"""A checkpoint folder of the project's format holding random weights of a GPT of any shape, written a slice at a
time, so a big one costs no memory to make: the export's memory benchmark (benchmarks/bench_export.py) and its test
(tests/test_interop_sharded.py) stream it."""

from __future__ import annotations

import dataclasses
from pathlib import Path


def write_synthetic_checkpoint(directory: Path, num_layers: int, hidden_size: int, vocab_size: int, num_heads=4):
    """A checkpoint folder of the project's format holding random model-space weights of a GPT of this shape,
    written a slice at a time (so a big one costs no memory to make)."""
    import torch

    from mtnlg_lightning.checkpoint.format import WrittenFile, file_digest, write_manifest, write_meta
    from mtnlg_lightning.checkpoint.safetensors_shards import TensorSpec, write_safetensors
    from mtnlg_lightning.config import get_config
    from mtnlg_lightning.model import build_model

    overrides = dict(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, vocab_size=vocab_size)
    config = get_config("gpt3-125m", **overrides, seq_len=1024, max_position_embeddings=1024)
    shapes = {name: tuple(p.shape) for name, p in build_model(config, device="meta").named_parameters()}
    shapes.pop("lm_head.weight", None)  # tied: stored once
    shapes["embed.wte.weight"] = (config.vocab_size, hidden_size)  # the format stores no vocabulary padding

    def random_rows(shape):
        return lambda r0, r1: torch.randn((r1 - r0, *shape[1:])) * 0.02

    directory.mkdir(parents=True)
    name = "rank-00000.safetensors"
    specs = [TensorSpec(f"model/{n}", s, torch.float32, random_rows(s)) for n, s in sorted(shapes.items())]
    write_safetensors(directory / name, specs)
    written = WrittenFile(name, (directory / name).stat().st_size, file_digest(directory / name))
    for spec in specs:
        written.pieces[spec.name] = {
            "global_shape": list(spec.shape),
            "dtype": "float32",
            "offsets": [0] * len(spec.shape),
            "shape": list(spec.shape),
        }
    meta = write_meta(directory, {"hyper_parameters": {"preset": "gpt3-125m", "model_overrides": overrides}})
    info = {"model_config": dataclasses.asdict(config), "global_step": 0, "consumed_samples": 0}
    write_manifest(directory, [written, meta], info)
    return directory
