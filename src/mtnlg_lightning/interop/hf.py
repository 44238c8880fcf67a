"""Hugging Face model directories: read one as a model source, write one from a checkpoint (atomically).

Families: GPT-2 (`interop/gpt2_mapping.py`), Llama 3, Qwen 2 and Qwen 3, and the mixtures of experts Qwen 3-MoE, Qwen
2-MoE, Mixtral and OLMoE (`interop/llama_mapping.py`), DeepSeek-V3 and GLM-4.5 (`interop/deepseek_mapping.py`), Gemma
3 text (`interop/gemma3_mapping.py`), GPT-OSS (`interop/gpt_oss_mapping.py`), Qwen3-Next
(`interop/qwen3_next_mapping.py`), told apart by `config.json`'s `model_type`; the architecture is read from it (the
user does not restate it) and the imported config names its family
(`ModelConfig.family`); an export writes the family the checkpoint's config names. A directory holds `config.json`,
`model.safetensors` (or shards with an index, or a `pytorch_model.bin` read with `weights_only=True`), the tokenizer
files and `generation_config.json`. Both ways the weights move one tensor (or one slice of rows) at a time: memory holds
a few shards, not the model.
`trust_remote_code` is never used: no code from a model directory runs.
"""

from __future__ import annotations

import dataclasses
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
    parse_size,
    tensor_progress,
    write_sharded,
)
from mtnlg_lightning.checkpoint.validate import expected_shapes
from mtnlg_lightning.config import ModelConfig
from mtnlg_lightning.data.chat_template import ChatTokenizer, has_chat_template
from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.extras import require_extra
from mtnlg_lightning.families import family_of
from mtnlg_lightning.interop import (
    deepseek_mapping,
    gemma3_mapping,
    gpt2_mapping,
    gpt_oss_mapping,
    llama_mapping,
    qwen3_next_mapping,
)
from mtnlg_lightning.interop.lora_base import base_path, with_base
from mtnlg_lightning.outputs import staged_dir

# config.json's model_type -> the mapping module that reads and writes it
MAPPINGS = {
    kind: mapping
    for mapping in (gpt2_mapping, llama_mapping, deepseek_mapping, gemma3_mapping, gpt_oss_mapping, qwen3_next_mapping)
    for kind in mapping.MODEL_TYPES
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Mixtures of experts whose design this decoder does not have: named in the one line that refuses them.
UNSUPPORTED_DESIGNS = {
    "deepseek_v2": "multi-head latent attention (MLA) and group-limited routing",
    "dbrx": "a fused q/k/v with clipping and its own expert layout",
    "jamba": "Mamba layers between the attention blocks",
}


def _transformers():
    require_extra("hf", "Hugging Face export")
    import transformers  # optional extra [hf]: imported on use, after the one-line check above

    return transformers


def is_hf_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def _mapping_and_config(path: Path):
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise MTNLGError(f"{path / 'config.json'} is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise MTNLGError(f"{path / 'config.json'} is not a JSON object")
    kind = cfg.get("model_type")
    if kind in UNSUPPORTED_DESIGNS:
        raise MTNLGError(
            f"{path} holds a {kind} mixture of experts, whose {UNSUPPORTED_DESIGNS[kind]} this decoder does not "
            f"have; the architectures that can be read are {', '.join(sorted(MAPPINGS))}"
        )
    if kind not in MAPPINGS:
        named = ", ".join(cfg.get("architectures") or []) if isinstance(cfg.get("architectures"), list) else ""
        raise MTNLGError(
            f"{path} holds a {kind!r} model{f' ({named})' if named else ''}; the architectures that can be read "
            f"are {', '.join(sorted(MAPPINGS))}"
        )
    mapping = MAPPINGS[kind]
    return mapping, mapping.read_config(cfg, path)


def mapping_for(config: ModelConfig):
    """The mapping module (`gpt2_mapping`, `llama_mapping`) that writes the family `config` names."""
    return MAPPINGS[family_of(config, "a Hugging Face export").hf_model_type]


class _StateDictTensors:
    """A `pytorch_model.bin` state dict seen as `ShardedTensors` (names, shapes, read)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.names = list(state)
        self.shapes = {k: tuple(v.shape) for k, v in state.items()}

    def read(self, name: str) -> torch.Tensor:
        return self.state[name]


class HFWeights(LazyWeights):
    """The model-space weights of a Hugging Face directory, read one tensor at a time from `model.safetensors`, the
    shards its index names or a `pytorch_model.bin` (fp32 as stored, or upcast). Construction checks names and
    files and reads no weights: a missing or unknown tensor, a shard that is missing or outside the directory is one
    line before any read."""

    def __init__(self, path: Path, config: ModelConfig, mapping, files):
        self.files, self.config, self.mapping = files, config, mapping
        stored = {mapping.normalize(name): name for name in self.files.names}
        # A mapping whose tensors depend on how the file stores them (GPT-OSS's MXFP4 experts) is given the names.
        in_files = getattr(mapping, "sources_in", None)
        self.sources = in_files(config, self.files.names) if in_files else mapping.sources(config)
        self.stored = {}
        super().__init__(self.sources)
        for theirs in (name for names in self.sources.values() for name in names):
            if theirs in self.stored:  # one of theirs may make several of ours (GPT-OSS's gate_up_proj)
                continue
            if theirs not in stored:
                short = theirs.removeprefix("transformer.")
                raise MTNLGError(
                    f"{path} has no tensor {short!r} (not a {config.num_layers}-layer model of its config?)"
                )
            # one tensor may feed several of ours (rows of it: MLA's latent and rotary key)
            self.stored.setdefault(theirs, stored.pop(theirs, None))
        self.head = stored.pop(mapping.HEAD, None) if config.tie_embeddings else None
        leftover = sorted(name for name in stored if not mapping.is_constant(name, config))
        if leftover:
            raise MTNLGError(f"{path} has tensors this model does not use: {', '.join(leftover[:5])}")

    def shape(self, name: str) -> tuple[int, ...]:
        shapes = [self.files.shapes[self.stored[theirs]] for theirs in self.sources[name]]
        return tuple(self.mapping.ours_shape(name, shapes, self.config))

    def __getitem__(self, name: str) -> torch.Tensor:
        tensors = [self.files.read(self.stored[theirs]) for theirs in self.sources[name]]
        if (
            name == "embed.wte.weight"
            and self.head is not None
            and not torch.equal(self.files.read(self.head), tensors[0])
        ):
            raise MTNLGError("the source's lm_head is not tied to its word embedding, though its config ties them")
        return self.mapping.from_hf(name, tensors, self.config).float()


def _read_hf_weights(path: Path, config: ModelConfig, mapping) -> Mapping[str, torch.Tensor]:
    if (path / "model.safetensors").is_file() or (path / f"model.safetensors{INDEX_SUFFIX}").is_file():
        return HFWeights(path, config, mapping, ShardedTensors(path))
    if (path / "pytorch_model.bin").is_file():  # files from elsewhere never run code: tensors only
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return HFWeights(path, config, mapping, _StateDictTensors(state))
    raise MTNLGError(f"{path} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def read_hf_dir(path: str | Path, mtp_layers: int = 0) -> ModelState:
    """A local Hugging Face directory as a `ModelState`: its model-space weights read lazily, one at a time.
    `mtp_layers`: the multi-token prediction depths to read too (DeepSeek-V3's `num_nextn_predict_layers`; 0: the
    decoder alone, as transformers' model reads it)."""
    path = Path(path)
    mapping, config = _mapping_and_config(path)
    if mtp_layers:
        config = dataclasses.replace(config, mtp_layers=mtp_layers)
    try:
        weights = _read_hf_weights(path, config, mapping)
    except MTNLGError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt weights file is one line for the user
        raise MTNLGError(f"cannot read the weights in {path} ({type(exc).__name__}: {exc})") from None
    _check_hf_shapes(path, weights, config)
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "vocab.json").is_file()
    tokenizer = path if has_tokenizer else None
    return ModelState(config, weights, {"init_from": str(path)}, tokenizer, chat=tokenizer)


def _check_hf_shapes(path: Path, weights: Mapping[str, torch.Tensor], config: ModelConfig) -> None:
    """Every tensor has the shape config.json implies (checked before the weights go into a model)."""
    names = set(weights)  # iterating a lazy mapping reads no tensor; `in` on it would
    for name, shape in expected_shapes(config, len(names)).items():
        if name not in names:
            continue
        found = weights.shape(name) if isinstance(weights, LazyWeights) else tuple(weights[name].shape)
        if tuple(found) != shape:
            raise MTNLGError(f"{path}: {name} is {list(found)}, config.json implies {list(shape)}")


def read_source(path: str | Path, verify: str = "all", mtp_layers: int = 0) -> ModelState:
    """A project checkpoint (any layout `read_model_state` reads; `verify` as there) or a Hugging Face directory:
    its architecture, tokenizer and lazily read model-space weights (checked by name and shape, none read yet). A
    LoRA checkpoint reads as its base with the adapters merged (the base checked against the recorded hash).
    `mtp_layers`: a Hugging Face directory's multi-token prediction depths to read too (`read_hf_dir`)."""
    state = read_hf_dir(path, mtp_layers) if is_hf_dir(path) else read_model_state(path, verify=verify)
    if state.lora is not None:
        state = with_base(state, read_source(base_path(state), verify))
    return state


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
    """Write `state` as a Hugging Face directory of the family its config names (`mapping_for`) at `output` (temp
    dir, then rename), its weights streamed into shards of at most `max_shard_size` bytes (Hugging Face's layout).
    Returns a summary; its `tokenizer` is None when none was known (the model is still written: pass one later or
    copy its files in). The tokenizer goes with the source's chat template (`state.chat`; a `tokenizer` directory's
    own first)."""
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
    mapping = mapping_for(config)
    eod_id = tok.eod_id if tok else None
    vocab = config.vocab_size
    if tok is not None:  # the padded rows and any rows past the tokenizer's ids are never produced: trim them
        if tok.vocab_size > config.vocab_size:
            raise MTNLGError(f"tokenizer {tokenizer} has {tok.vocab_size} tokens, the model only {config.vocab_size}")
        vocab = tok.vocab_size
    specs = mapping.tensor_specs(weights, config, vocab, DTYPES[dtype])
    hf_config = mapping.hf_config(transformers, config, vocab, eod_id, str(DTYPES[dtype]).removeprefix("torch."))
    with staged_dir(output) as tmp:  # the previous output stays until this one is complete
        hf_config.save_pretrained(tmp)
        written = write_sharded(tmp, specs, shard_bytes, progress=tensor_progress(len(specs), f"writing {output.name}"))
        chat_dir = tokenizer if has_chat_template(tokenizer) else state.chat  # --tokenizer DIR brings its own
        chat = write_tokenizer(tmp, tok, chat_dir, config.max_position_embeddings) if tok is not None else None
        generation_config(transformers, tok, chat).save_pretrained(tmp)
    return {
        "output": str(output),
        "architecture": hf_config.architectures[0],
        "family": family_of(config).label,
        "parameters": sum(spec.nbytes // spec.dtype.itemsize for spec in specs),
        "shards": written["shards"],
        "bytes": written["bytes"],
        "vocab_size": vocab,
        "dtype": dtype,
        "tokenizer": str(tokenizer) if tokenizer else None,
        "chat_template": chat is not None,
    }


def write_tokenizer(directory: Path, tok: Tokenizer, chat_dir: Path | None, max_positions: int) -> ChatTokenizer | None:
    """The tokenizer as transformers saves one (tokenizer.json, tokenizer_config.json), with the chat template of
    `chat_dir` if it has one (chat_template.jinja) and that template's special tokens, exactly those it renders
    with, so that `AutoTokenizer.from_pretrained(directory).apply_chat_template` gives our ids. Without a template,
    the end-of-text token is bos, eos and unk (as GPT-2's). Returns the template over the written tokenizer."""
    transformers = _transformers()
    tok.save(directory / "tokenizer.json")
    chat = None
    if has_chat_template(chat_dir):
        chat = ChatTokenizer(chat_dir, tokenizer_file=directory / "tokenizer.json")
        settings = {**chat.special_tokens, "chat_template": chat.template_text}
    else:
        settings = dict(bos_token=tok.eod_token, eos_token=tok.eod_token, unk_token=tok.eod_token)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), model_max_length=max_positions, **settings
    )
    fast.save_pretrained(directory)
    return chat


def generation_config(transformers, tok: Tokenizer | None, chat: ChatTokenizer | None):
    """generation_config.json: generation stops at the end-of-text token and, with a chat template, at the end of
    the assistant's turn first (its token ids; `stop_strings` where the marker is no single token here, which
    transformers' generate applies when given the tokenizer)."""
    eod_id = tok.eod_id if tok is not None else None
    if chat is None:
        return transformers.GenerationConfig(bos_token_id=eod_id, eos_token_id=eod_id)
    end = chat.end_of_turn([eod_id])
    bos = chat.special_tokens.get("bos_token")
    bos_id = chat.tokenizer.token_to_id(bos) if bos is not None else None
    stops = {"stop_strings": list(end.texts)} if end.texts else {}
    eos = list(end.ids) if len(end.ids) > 1 else end.ids[0]
    return transformers.GenerationConfig(bos_token_id=eod_id if bos_id is None else bos_id, eos_token_id=eos, **stops)
