"""Build a fresh Llama from a config dict (pretraining from scratch), and find the HF model inside the wrappers
training puts around it; loading a checkpoint is memfit.hf."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.errors import UserError


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


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP/DataParallel, torch.compile and PEFT wrappers."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)):  # PeftModel
            model = model.get_base_model()
        else:
            return model
