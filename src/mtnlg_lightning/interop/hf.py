"""Hugging Face GPT-2 directories: read one as a model source, write one from a checkpoint (atomically).

A directory holds `config.json` (`model_type: gpt2`), `model.safetensors` (or shards with an index, or a
`pytorch_model.bin` read with `weights_only=True`), the tokenizer files and `generation_config.json`. Both ways
the weights move one tensor (or one slice of rows) at a time: memory holds a few shards, not the model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from mtnlg_lightning.checkpoint import ModelState, read_model_state
from mtnlg_lightning.checkpoint.model_state import LazyWeights, as_lazy
from mtnlg_lightning.checkpoint.safetensors_shards import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_SUFFIX,
    ShardedTensors,
    TensorSpec,
    parse_size,
    tensor_progress,
    write_sharded,
)
from mtnlg_lightning.checkpoint.validate import expected_shapes
from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.data.tokenizer import EOD_TOKEN, Tokenizer
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.extras import require_extra
from mtnlg_lightning.interop.gpt2_mapping import CONSTANT_BUFFERS, TensorPair, from_hf, tensor_pairs
from mtnlg_lightning.outputs import staged_dir

TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # both are GeLU with the tanh approximation, as our MLP
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _transformers():
    require_extra("hf", "Hugging Face export")
    import transformers  # optional extra [hf]: imported on use, after the one-line check above

    return transformers


def is_hf_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def read_hf_config(path: str | Path) -> ModelConfig:
    """The architecture of a GPT-2 directory as a `ModelConfig`; any other architecture is one line."""
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise MTNLGError(f"{path / 'config.json'} is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise MTNLGError(f"{path / 'config.json'} is not a JSON object")
    model_type = cfg.get("model_type")
    if model_type != "gpt2":
        raise MTNLGError(f"{path} holds a {model_type!r} model; only GPT-2-architecture models (gpt2) can be imported")
    problems = []
    if cfg.get("activation_function", "gelu_new") not in TANH_GELUS:
        problems.append(f"activation_function {cfg['activation_function']!r} (this GPT uses tanh GeLU)")
    if not cfg.get("scale_attn_weights", True) or cfg.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("non-standard attention scaling")
    if not cfg.get("tie_word_embeddings", True):
        problems.append("an untied LM head")
    if problems:
        raise MTNLGError(f"{path}: GPT-2 variant with {', '.join(problems)} cannot be imported")
    _check_hf_keys(path, cfg)
    n_positions = cfg.get("n_positions", 1024)
    return ModelConfig(
        num_layers=cfg["n_layer"],
        hidden_size=cfg["n_embd"],
        num_heads=cfg["n_head"],
        seq_len=n_positions,
        vocab_size=cfg["vocab_size"],
        ffn_hidden_size=cfg.get("n_inner") or 4 * cfg["n_embd"],
        max_position_embeddings=n_positions,
        hidden_dropout=cfg.get("resid_pdrop", 0.0),
        attention_dropout=cfg.get("attn_pdrop", 0.0),
        layernorm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        name=cfg.get("_name_or_path") or path.name,
    )


# GPT-2 config keys written from the model config on export (the vocabulary is the tokenizer's; import reads the
# same keys back in `read_hf_config`, with GPT-2's defaults for the optional ones).
EXPORTED_FIELDS = {
    "n_positions": "max_position_embeddings",
    "n_embd": "hidden_size",
    "n_layer": "num_layers",
    "n_head": "num_heads",
    "n_inner": "ffn_hidden_size",
    "resid_pdrop": "hidden_dropout",
    "embd_pdrop": "hidden_dropout",
    "attn_pdrop": "attention_dropout",
    "layer_norm_epsilon": "layernorm_eps",
    "initializer_range": "init_std",
}
HF_REQUIRED = ("n_layer", "n_embd", "n_head", "vocab_size")
HF_OPTIONAL_INTS = ("n_positions", "n_inner")
HF_RATES = ("resid_pdrop", "attn_pdrop", "embd_pdrop")


def _check_hf_keys(path: Path, cfg: dict) -> None:
    """The keys the import reads, by type and range: a missing or wrong one is one line naming it."""
    where = path / "config.json"
    for key in HF_REQUIRED + HF_OPTIONAL_INTS:
        value = cfg.get(key)
        if key in HF_REQUIRED and key not in cfg:
            raise MTNLGError(f"{where} has no {key!r} (a GPT-2 config needs {', '.join(HF_REQUIRED)})")
        if (key in HF_REQUIRED or value is not None) and not (
            isinstance(value, int) and not isinstance(value, bool) and value >= 1
        ):
            raise MTNLGError(f"{where}: {key} is {value!r}, expected an integer >= 1")
    for key in (*HF_RATES, "layer_norm_epsilon"):
        value = cfg.get(key, 0.0)
        if not (isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1):
            raise MTNLGError(f"{where}: {key} is {value!r}, expected a number in [0, 1)")


class HFWeights(LazyWeights):
    """The model-space weights of a GPT-2 directory, read one tensor at a time from `model.safetensors` or the
    shards its index names (fp32 as stored, or upcast). Construction checks names and files and reads no weights:
    a missing or unknown tensor, a shard that is missing or outside the directory is one line before any read."""

    def __init__(self, path: Path, config: ModelConfig):
        super().__init__()
        self.files, self.heads = ShardedTensors(path), config.num_heads
        stored = {name.removeprefix("transformer."): name for name in self.files.names}
        self.pairs, self.stored = {}, {}
        for pair in tensor_pairs(config.num_layers):
            short = pair.theirs.removeprefix("transformer.")
            if short not in stored:
                raise MTNLGError(f"{path} has no tensor {short!r} (not a GPT-2 model of {config.num_layers} layers?)")
            self.pairs[pair.ours], self.stored[pair.ours] = pair, stored.pop(short)
        self.head = stored.pop("lm_head.weight", None)
        leftover = sorted(k for k in stored if not k.endswith(CONSTANT_BUFFERS))
        if leftover:
            raise MTNLGError(f"{path} has tensors this GPT does not use: {', '.join(leftover[:5])}")

    def __iter__(self):
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.pairs[name].hf_shape(self.files.shapes[self.stored[name]])  # a transpose is its own inverse

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.files.read(self.stored[name])
        if name == "embed.wte.weight" and self.head is not None and not torch.equal(self.files.read(self.head), tensor):
            raise MTNLGError("the source's lm_head is not tied to its word embedding; this GPT ties them")
        return self.pairs[name].from_hf(tensor, self.heads).float()


def _read_hf_weights(path: Path, config: ModelConfig) -> Mapping[str, torch.Tensor]:
    if (path / "model.safetensors").is_file() or (path / f"model.safetensors{INDEX_SUFFIX}").is_file():
        return HFWeights(path, config)
    if (path / "pytorch_model.bin").is_file():  # files from elsewhere never run code: tensors only
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return {k: v.float() for k, v in from_hf(state, config).items()}
    raise MTNLGError(f"{path} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def read_hf_dir(path: str | Path) -> ModelState:
    """A local GPT-2 directory as a `ModelState`: its model-space weights read lazily, one tensor at a time."""
    path = Path(path)
    config = read_hf_config(path)
    try:
        weights = _read_hf_weights(path, config)
    except MTNLGError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt weights file is one line for the user
        raise MTNLGError(f"cannot read the weights in {path} ({type(exc).__name__}: {exc})") from None
    _check_hf_shapes(path, weights, config)
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "vocab.json").is_file()
    return ModelState(config, weights, {"init_from": str(path)}, path if has_tokenizer else None)


def _check_hf_shapes(path: Path, weights: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    """Every tensor has the shape config.json implies (checked before the weights go into a model)."""
    names = set(weights)  # iterating a lazy mapping reads no tensor; `in` on it would
    for name, shape in expected_shapes(config, len(names)).items():
        if name not in names:
            continue
        found = weights.shape(name) if isinstance(weights, LazyWeights) else tuple(weights[name].shape)
        if tuple(found) != shape:
            raise MTNLGError(f"{path}: {name} is {list(found)}, config.json implies {list(shape)}")


def read_source(path: str | Path) -> ModelState:
    """A project checkpoint (any layout `read_model_state` reads) or a Hugging Face GPT-2 directory."""
    return read_hf_dir(path) if is_hf_dir(path) else read_model_state(path)


def source_config(path: str | Path) -> ModelConfig:
    """The architecture of a source, checking its weights' names and files but reading no tensor."""
    return read_source(path).config


# ------------------------------------------------------------------------------------------------ export
def export_hf(
    state: ModelState,
    output: str | Path,
    dtype: str = "fp32",
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
) -> dict:
    """Write `state` as a GPT-2 directory `output` (temp dir, then rename), its weights streamed into shards of at
    most `max_shard_size` bytes (Hugging Face's layout). Returns a summary; its `tokenizer` is None when none was
    known (the model is still written: pass one later or copy its files in)."""
    transformers = _transformers()

    output = Path(output)
    shard_bytes = parse_size(max_shard_size)
    if dtype not in DTYPES:
        raise MTNLGError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if output.exists() and not overwrite and any(output.iterdir()):
        raise MTNLGError(f"{output} exists and is not empty (pass --overwrite to replace it)")
    tokenizer = tokenizer or state.tokenizer
    tok = Tokenizer(tokenizer) if tokenizer else None
    config, weights = state.config, as_lazy(state.weights)
    eod_id = tok.eod_id if tok else None
    vocab = config.vocab_size
    if tok is not None:  # the padded rows and any rows past the tokenizer's ids are never produced: trim them
        if tok.vocab_size > config.vocab_size:
            raise MTNLGError(f"tokenizer {tokenizer} has {tok.vocab_size} tokens, the model only {config.vocab_size}")
        vocab = tok.vocab_size
    specs = hf_tensor_specs(weights, config, vocab, DTYPES[dtype])
    hf_config = transformers.GPT2Config(
        vocab_size=vocab,
        **{key: getattr(config, field) for key, field in EXPORTED_FIELDS.items()},
        activation_function="gelu_new",
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        tie_word_embeddings=True,
        architectures=["GPT2LMHeadModel"],
        dtype=str(DTYPES[dtype]).removeprefix("torch."),
    )
    with staged_dir(output) as tmp:  # the previous output stays until this one is complete
        hf_config.save_pretrained(tmp)
        written = write_sharded(tmp, specs, shard_bytes, progress=tensor_progress(len(specs), f"writing {output.name}"))
        transformers.GenerationConfig(bos_token_id=eod_id, eos_token_id=eod_id).save_pretrained(tmp)
        if tok is not None:
            tok.save(tmp / "tokenizer.json")
            fast = transformers.PreTrainedTokenizerFast(
                tokenizer_file=str(tmp / "tokenizer.json"),
                bos_token=EOD_TOKEN,
                eos_token=EOD_TOKEN,
                unk_token=EOD_TOKEN,
                model_max_length=config.max_position_embeddings,
            )
            fast.save_pretrained(tmp)
    return {
        "output": str(output),
        "parameters": sum(spec.nbytes // spec.dtype.itemsize for spec in specs),
        "shards": written["shards"],
        "bytes": written["bytes"],
        "vocab_size": vocab,
        "dtype": dtype,
        "tokenizer": str(tokenizer) if tokenizer else None,
    }


def hf_tensor_specs(weights: LazyWeights, config: ModelConfig, vocab: int, dtype: torch.dtype) -> list[TensorSpec]:
    """GPT-2's tensors, each produced rows at a time from boxes of our model-space tensors: GPT-2's rows of a
    Linear weight are our columns, of anything else our rows (the qkv bias, reordered whole, is small)."""

    def rows_of(pair: TensorPair, shape: tuple[int, ...]):
        def rows(r0: int, r1: int) -> torch.Tensor:
            if pair.linear_weight:
                return pair.to_hf(weights.read_box(pair.ours, (0, r0), (shape[0], r1 - r0)), config.num_heads)
            if pair.qkv:
                return pair.to_hf(weights.read_box(pair.ours, (0,), shape), config.num_heads)[r0:r1]
            return weights.read_box(pair.ours, (r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:]))

        return rows

    specs = []
    for pair in tensor_pairs(config.num_layers):
        shape = weights.shape(pair.ours)
        if pair.ours == "embed.wte.weight":  # the padded rows and any past the tokenizer's ids: never produced
            shape = (vocab, *shape[1:])
        specs.append(TensorSpec(pair.theirs, pair.hf_shape(shape), dtype, rows_of(pair, shape)))
    return specs
