"""Load a checkpoint dir safely or build a Llama from a config dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from training.errors import UserError


def check_checkpoint_dir(path: str, allow_pickle: bool) -> None:
    """Refuse missing dirs, dirs without weights, and pickle-only weights unless allowed."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"model_path: {path} is not a directory")
    if not (p / "config.json").is_file():
        raise UserError(f"model_path: {path} has no config.json")
    has_safetensors = any(p.glob("model*.safetensors"))
    has_pickle = any(p.glob("pytorch_model*.bin"))
    if not has_safetensors and not has_pickle:
        raise UserError(f"model_path: {path} holds no weights (model*.safetensors)")
    if not has_safetensors and has_pickle and not allow_pickle:
        raise UserError(
            f"model_path: {path} holds only pickle weights (.bin), which can run arbitrary code when loaded; "
            "convert to safetensors or pass --allow-pickle if you trust the source"
        )


def load_pretrained(path: str, allow_pickle: bool = False, trust_remote_code: bool = False,
                    **kwargs: Any) -> torch.nn.Module:
    check_checkpoint_dir(path, allow_pickle)
    has_safetensors = any(Path(path).glob("model*.safetensors"))
    # transformers (>= 5.2x, with its `kernels` dependency) swaps layers for kernels it downloads from the Hub
    # (kernels-community/*) when a model is loaded on a GPU or put in train mode: code fetched at run time, which
    # memfit never runs (no hub access, as with trust_remote_code). Offline that load failed outright (seen on an
    # H200: "Version 2 of 'kernels-community/rotary' is not available in the local cache").
    kwargs.setdefault("use_kernels", False)
    try:
        return AutoModelForCausalLM.from_pretrained(
            path, use_safetensors=has_safetensors, trust_remote_code=trust_remote_code,
            dtype=kwargs.pop("dtype", torch.float32), **kwargs,
        )
    except (OSError, ValueError) as e:
        raise UserError(f"model_path: could not load {path}: {e}") from None


def load_tokenizer(path: str, trust_remote_code: bool = False):
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"tokenizer: could not load one from {path}: {e}") from None


def build_llama(model_config: dict[str, Any], tokenizer, seed: int) -> LlamaForCausalLM:
    known = set(LlamaConfig().to_dict())
    unknown = sorted(set(model_config) - known)
    if unknown:
        raise UserError(f"model_config: unknown LlamaConfig key(s) {', '.join(unknown)}")
    cfg = dict(model_config)
    cfg.setdefault("vocab_size", len(tokenizer))
    if cfg["vocab_size"] < len(tokenizer):
        raise UserError(f"model_config.vocab_size {cfg['vocab_size']} < tokenizer size {len(tokenizer)}")
    config = LlamaConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **cfg,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
