"""Hugging Face GPT-2 directories: read one as a model source, write one from a checkpoint (atomically).

A directory holds `config.json` (`model_type: gpt2`), `model.safetensors` (or shards with an index, or a
`pytorch_model.bin` read with `weights_only=True`), the tokenizer files and `generation_config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mtnlg_lightning.checkpoint import ModelState, read_model_state
from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.data.tokenizer import EOD_TOKEN, Tokenizer
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.interop.gpt2_mapping import from_hf, to_hf
from mtnlg_lightning.outputs import staged_dir

TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # both are GeLU with the tanh approximation, as our MLP
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MTNLGError("Hugging Face interop needs transformers: pip install 'mtnlg-lightning[hf]'") from None
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


def _shard_names(path: Path, index: Path) -> list[str]:
    """The shard files of a sharded safetensors index, each a plain name inside the directory."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, RecursionError, AttributeError) as exc:
        raise MTNLGError(f"{index} is not a readable index ({type(exc).__name__})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise MTNLGError(f"{index} has no weight_map of tensor names to shard files")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not shard or shard in (".", "..") or any(c in shard for c in "/\\\0"):
            raise MTNLGError(f"{index} names the shard {shard!r}, which is not a plain file name inside {path}")
        if not (path / shard).is_file():
            raise MTNLGError(f"{index} names the shard {shard}, which is not in {path}")
    return shards


def _read_hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (path / "model.safetensors").is_file():
        return load_file(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = _shard_names(path, index)
        return {k: v for shard in shards for k, v in load_file(path / shard).items()}
    if (path / "pytorch_model.bin").is_file():  # files from elsewhere never run code: tensors only
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise MTNLGError(f"{path} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def read_hf_dir(path: str | Path) -> ModelState:
    """A local GPT-2 directory as a `ModelState` (model-space weights, fp32 as stored or upcast)."""
    path = Path(path)
    config = read_hf_config(path)
    try:
        tensors = _read_hf_tensors(path)
    except MTNLGError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt weights file is one line for the user
        raise MTNLGError(f"cannot read the weights in {path} ({type(exc).__name__}: {exc})") from None
    weights = {k: v.float() for k, v in from_hf(tensors, config).items()}
    _check_hf_shapes(path, weights, config)
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "vocab.json").is_file()
    return ModelState(config, weights, {"init_from": str(path)}, path if has_tokenizer else None)


def _check_hf_shapes(path: Path, weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Every tensor has the shape config.json implies (checked before the weights go into a model)."""
    from mtnlg_lightning.checkpoint.validate import expected_shapes

    for name, shape in expected_shapes(config, len(weights)).items():
        if name in weights and tuple(weights[name].shape) != shape:
            raise MTNLGError(f"{path}: {name} is {list(weights[name].shape)}, config.json implies {list(shape)}")


def read_source(path: str | Path) -> ModelState:
    """A project checkpoint (any layout `read_model_state` reads) or a Hugging Face GPT-2 directory."""
    return read_hf_dir(path) if is_hf_dir(path) else read_model_state(path)


def source_config(path: str | Path) -> ModelConfig:
    """The architecture of a source, reading only its config where the format allows."""
    return read_hf_config(path) if is_hf_dir(path) else read_model_state(path).config


# ------------------------------------------------------------------------------------------------ export
def export_hf(
    state: ModelState,
    output: str | Path,
    dtype: str = "fp32",
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
) -> dict:
    """Write `state` as a GPT-2 directory `output` (temp dir, then rename). Returns a summary; its `tokenizer` is
    None when none was known (the model is still written: pass one later or copy its files in)."""
    transformers = _transformers()
    from safetensors.torch import save_file

    output = Path(output)
    if dtype not in DTYPES:
        raise MTNLGError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if output.exists() and not overwrite and any(output.iterdir()):
        raise MTNLGError(f"{output} exists and is not empty (pass --overwrite to replace it)")
    tokenizer = tokenizer or state.tokenizer
    tok = Tokenizer(tokenizer) if tokenizer else None
    config, weights = state.config, dict(state.weights)
    eod_id = tok.eod_id if tok else None
    vocab = config.vocab_size
    if tok is not None:  # the padded rows and any rows past the tokenizer's ids are never produced: trim them
        if tok.vocab_size > config.vocab_size:
            raise MTNLGError(f"tokenizer {tokenizer} has {tok.vocab_size} tokens, the model only {config.vocab_size}")
        vocab = tok.vocab_size
        weights["embed.wte.weight"] = weights["embed.wte.weight"][:vocab]
    tensors = {k: v.to(DTYPES[dtype]).contiguous() for k, v in to_hf(weights, config).items()}
    hf_config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size,
        n_layer=config.num_layers,
        n_head=config.num_heads,
        n_inner=config.ffn_hidden_size,
        activation_function="gelu_new",
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout,
        layer_norm_epsilon=config.layernorm_eps,
        initializer_range=config.init_std,
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        tie_word_embeddings=True,
        architectures=["GPT2LMHeadModel"],
        dtype=str(DTYPES[dtype]).removeprefix("torch."),
    )
    with staged_dir(output) as tmp:  # the previous output stays until this one is complete
        hf_config.save_pretrained(tmp)
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
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
        "parameters": sum(t.numel() for t in tensors.values()),
        "vocab_size": vocab,
        "dtype": dtype,
        "tokenizer": str(tokenizer) if tokenizer else None,
    }
