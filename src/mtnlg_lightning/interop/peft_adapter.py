"""A LoRA checkpoint's adapter as a PEFT directory (`mtnlg-export-hf CKPT OUT --adapter`), which
`peft.PeftModel.from_pretrained(base, OUT)` and vLLM's LoRA loader read:

- `adapter_config.json`: peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout, use_rslora,
  target_modules (Hugging Face's module names) and base_model_name_or_path (the base the run recorded; without it
  peft fails with a KeyError, torchtune#2025);
- `adapter_model.safetensors`: `base_model.model.<Hugging Face module>.lora_A.weight` (r, in) and `.lora_B.weight`
  (out, r), and nothing else: no `modules_to_save`, no LM head, which vLLM rejects (vllm#9280); every tensor whole,
  in model space (not ZeRO-3's 1-D shards, peft#3251);
- the run's tokenizer with its chat template (tokenizer.json, tokenizer_config.json, chat_template.jinja), as
  adapters are shared (TRL's trainer saves them beside the adapter, and vLLM's server renders a LoRA request's chat
  with the adapter directory's tokenizer when it has one); peft itself reads only the two files above.

Hugging Face's modules: a Llama / Qwen block's q_proj ... down_proj (our fused q/k/v of a model with as many
key/value heads as query heads becomes q_proj, k_proj and v_proj: A repeated, B's rows split, which is exact);
GPT-2's c_attn (fused there too: B's rows reordered [heads, 3, hd] -> [3, heads, hd]), attn.c_proj, c_fc and
mlp.c_proj, whose Conv1D weights peft adapts with fan_in_fan_out. The RoPE layout is Hugging Face's on both sides:
q and k need no permutation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtnlg_lightning.checkpoint import ModelState
from mtnlg_lightning.data.chat_template import has_chat_template
from mtnlg_lightning.data.tokenizer import Tokenizer
from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.families import family_of
from mtnlg_lightning.family_specs import BLOCK
from mtnlg_lightning.interop import gpt2_mapping, llama_mapping
from mtnlg_lightning.interop.hf import DTYPES, mapping_for, write_tokenizer
from mtnlg_lightning.interop.lora_base import base_path
from mtnlg_lightning.outputs import staged_dir
from mtnlg_lightning.parallel.lora import adapter_names, lora_config

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _hf_parts(module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, config, mapping):
    """(Hugging Face module path, A, B) for our adapter of `module` (`blocks.N.attn.q`): the module's Hugging Face
    name from the spec of the family its config names (`family_specs.py`); a fused q/k/v that Hugging Face keeps
    apart gives one adapter each."""
    _, layer, ours = module.split(".", 2)
    _, theirs = family_of(config, "a PEFT adapter").modules[f"{BLOCK}{ours}"]
    if mapping is gpt2_mapping and ours == "attn.qkv":
        lora_b = gpt2_mapping._qkv_to_hf(lora_b, config.num_heads)
    if isinstance(theirs, tuple):  # q_proj, k_proj, v_proj of our one projection: A repeated, B's rows split
        parts = llama_mapping._split(lora_b, config.num_heads)
        return [(name.format(i=layer), lora_a, b) for name, b in zip(theirs, parts, strict=True)]
    return [(theirs.format(i=layer), lora_a, lora_b)]


def _target_modules(modules: list[str], mapping) -> list[str]:
    """peft's target_modules: each module's last name; GPT-2's c_proj (its attention's and its MLP's output) as
    `attn.c_proj` or `mlp.c_proj` when only one of them is adapted (peft matches a dotted suffix too)."""
    if mapping is not gpt2_mapping:
        return sorted({m.rsplit(".", 1)[-1] for m in modules})
    kinds = {".".join(m.split(".")[-2:]) for m in modules}  # attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
    both = {"attn.c_proj", "mlp.c_proj"} <= kinds
    return sorted({k if k.endswith("c_proj") and not both else k.split(".")[-1] for k in kinds})


def adapter_tensors(state: ModelState) -> tuple[dict[str, torch.Tensor], list[str]]:
    """peft's tensors of a LoRA checkpoint and its target modules."""
    lora = lora_config(state.lora)
    mapping = mapping_for(state.config)
    tensors, modules = {}, []
    for module in adapter_names(state.config, lora):
        lora_a, lora_b = state.weights[f"{module}.lora_a"], state.weights[f"{module}.lora_b"]
        for hf_module, a, b in _hf_parts(module, lora_a, lora_b, state.config, mapping):
            tensors[f"{PEFT_PREFIX}{hf_module}.lora_A.weight"] = a.contiguous()
            tensors[f"{PEFT_PREFIX}{hf_module}.lora_B.weight"] = b.contiguous()
            modules.append(hf_module)
    return tensors, _target_modules(modules, mapping)


def peft_config(state: ModelState, target_modules: list[str]) -> dict:
    lora = lora_config(state.lora)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path(state),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.rslora,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": mapping_for(state.config) is gpt2_mapping,  # GPT-2's Conv1D stores weights [in, out]
        "modules_to_save": None,
        "inference_mode": True,
        "init_lora_weights": True,
    }


def write_peft_adapter(
    state: ModelState, output: str | Path, dtype: str = "fp32", overwrite: bool = False, tokenizer=None
) -> dict:
    """Write the PEFT directory (a temporary directory, then renamed). `state`: a LoRA checkpoint as
    `read_model_state` reads it (adapters only); `tokenizer`: instead of the one it carries."""
    output = Path(output)
    if dtype not in DTYPES:
        raise MTNLGError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if output.exists() and not overwrite and any(output.iterdir()):
        raise MTNLGError(f"{output} exists and is not empty (pass --overwrite to replace it)")
    tensors, targets = adapter_tensors(state)
    tensors = {name: t.to(DTYPES[dtype]).clone() for name, t in tensors.items()}  # a repeated A: its own copy
    config = peft_config(state, targets)
    tokenizer = tokenizer or state.tokenizer
    chat_dir = tokenizer if has_chat_template(tokenizer) else state.chat  # a tokenizer directory brings its own
    tokenizer = Tokenizer(tokenizer) if tokenizer is not None else None
    with staged_dir(output) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        chat = None
        if tokenizer is not None:
            chat = write_tokenizer(tmp, tokenizer, chat_dir, state.config.max_position_embeddings)
    return {
        "output": str(output),
        "target_modules": targets,
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "base": config["base_model_name_or_path"],
        "tokenizer": tokenizer is not None,
        "chat_template": chat is not None,
    }
