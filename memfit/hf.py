"""Hugging Face loading with memfit's safety policy, and the one NF4 (bitsandbytes) setting.

Policy: safetensors only unless the user passes --allow-pickle; no ``trust_remote_code`` unless asked by
flag; no layer kernels fetched from the Hub (transformers' ``use_kernels``); nothing downloaded at run time.
Every stage runs causal decoders (``AutoModelForCausalLM``): other checkpoints are refused by their config,
before any weight is read, with a message naming the architecture.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from memfit.errors import UserError
from memfit.modeldir import check_model_dir, read_config, weight_files

# class-name endings of the checkpoints AutoModelForCausalLM runs as saved: a head that predicts the next token
# (ForConditionalGeneration: multimodal decoders such as Gemma 3; encoder-decoders are refused before this)
_LM_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def not_causal_decoder(config: dict | object) -> str | None:
    """Why the model of ``config`` (config.json as a dict, or a transformers config) is not a causal decoder
    that ``AutoModelForCausalLM`` runs, or None where it is (as far as the config tells: BERT-style encoders
    that transformers also maps to a causal head are caught by their ``architectures``, else at run time by
    memfit.runtime.generic's causality probe)."""
    def get(key: str):
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    mt, archs = get("model_type"), list(get("architectures") or [])
    arch = archs[0] if archs else "no architectures listed"
    if not mt:
        return f"config.json has no model_type ({arch}): memfit runs AutoModelForCausalLM models"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if get("is_encoder_decoder"):
        why = "an encoder-decoder"
    elif "AutoModelForCausalLM" in (get("auto_map") or {}):
        return None  # remote code names its own causal LM class (its architectures may name the base model)
    elif mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        why = "AutoModelForCausalLM has no class for it (an encoder-only, vision or speech model)"
    elif archs and not any(a.endswith(_LM_HEADS) for a in archs):
        why = "the checkpoint has no causal LM head"
    else:
        return None
    return f"architecture {mt!r} ({arch}) is not a causal decoder: {why}; memfit runs AutoModelForCausalLM models"


def load_pretrained(path: str, allow_pickle: bool = False, trust_remote_code: bool = False, flag: str = "model_path",
                    **kwargs: Any) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` of a checked model dir, fp32 unless ``dtype`` says otherwise."""
    check_model_dir(path, flag, allow_pickle)
    problem = not_causal_decoder(read_config(path, flag))  # before the weights: AutoModelForCausalLM would load
    if problem:  # a BertModel as BertLMHeadModel (a random head) or fail with a list of 200 model types
        raise UserError(f"{flag}: {problem}")
    # transformers (>= 5.2x, with its `kernels` dependency) swaps layers for kernels it downloads from the Hub
    # (kernels-community/*) when a model is loaded on a GPU or put in train mode: code fetched at run time, which
    # memfit never runs (no hub access, as with trust_remote_code). Offline that load failed outright (seen on an
    # H200: "Version 2 of 'kernels-community/rotary' is not available in the local cache").
    kwargs.setdefault("use_kernels", False)
    try:
        return AutoModelForCausalLM.from_pretrained(
            path, use_safetensors=bool(weight_files(path)), trust_remote_code=trust_remote_code,
            dtype=kwargs.pop("dtype", torch.float32), **kwargs,
        )
    except (OSError, ValueError) as e:
        raise UserError(f"{flag}: could not load {path}: {e}") from None


def load_tokenizer(path: str, trust_remote_code: bool = False, flag: str = "tokenizer"):
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"{flag}: could not load a tokenizer from {path}: {e}") from None
    drop_build_tables(tok)
    return tok


def drop_build_tables(tok) -> int:
    """Free the Python vocabulary dict and merges list a fast tokenizer was built from; returns how many.

    Why: transformers' BPE tokenizer classes (Gemma's, Llama's, GPT-NeoX's...) keep the ``_vocab`` and
    ``_merges`` they passed to the Rust tokenizer, which holds its own copy and is all that encodes, decodes
    and saves afterwards. For Gemma 3's 262,144 tokens and 514,906 merges that was 160 MiB of the process
    (263 vs 103 MiB for the same tokenizer.json loaded as a plain fast tokenizer)."""
    if getattr(tok, "_tokenizer", None) is None:  # a slow (Python) tokenizer encodes with them
        return 0
    dropped = 0
    for name, kind in (("_vocab", dict), ("_merges", list)):
        if isinstance(tok.__dict__.get(name), kind):
            delattr(tok, name)
            dropped += 1
    return dropped


def nf4_config(compute_dtype: torch.dtype, skip: list[str] | None = None, double_quant: bool = False):
    """bitsandbytes NF4 (4-bit NormalFloat, blocks of 64) as transformers' ``quantization_config``: QLoRA's base
    (bf16 compute, double quantization), ``compress --method nf4`` and ``serve --quantize nf4`` (fp32 compute on
    CPU) all come through here."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                              bnb_4bit_use_double_quant=double_quant, llm_int8_skip_modules=skip or None)
