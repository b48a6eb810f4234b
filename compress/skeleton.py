"""Build a model on the meta device and fill it from a WeightSource module by module."""

from __future__ import annotations

import torch
from accelerate.utils import set_module_tensor_to_device
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from compress.store import WeightSource
from memfit.errors import UserError


def hf_config(path: str, trust_remote_code: bool = False) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{path}/config.json: cannot build a model config ({e})") from None


def meta_model(config: PretrainedConfig, trust_remote_code: bool = False) -> nn.Module:
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code,
                                                     dtype=torch.float32)
        except ValueError as e:
            raise UserError(f"unsupported model type {config.model_type!r}: {e}") from None
    return model


def decoder_layers(model: nn.Module, config: PretrainedConfig) -> tuple[str, nn.ModuleList]:
    n = getattr(config, "num_hidden_layers", None)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n:
            return name, mod
    raise UserError(f"cannot find the {n} decoder layers of {type(model).__name__}")


def materialize(module: nn.Module, prefix: str, src: WeightSource, dtype: torch.dtype = torch.float32,
                alias: dict[str, str] | None = None) -> None:
    """Load every parameter (and persistent buffer) of module from src as dtype, on CPU."""
    for name, p in list(module.named_parameters()):
        key = prefix + name
        if key not in src and alias and key in alias:
            key = alias[key]
        value = src.get(key)
        if tuple(value.shape) != tuple(p.shape):
            raise UserError(f"{src.path}: tensor {key} has shape {tuple(value.shape)}, the config implies "
                            f"{tuple(p.shape)}")
        set_module_tensor_to_device(module, name, "cpu", value=value.to(dtype))
    for name, b in list(module.named_buffers()):
        if b.is_meta and prefix + name in src:
            set_module_tensor_to_device(module, name, "cpu", value=src.get(prefix + name))


def fix_meta_buffers(model: nn.Module, config: PretrainedConfig) -> None:
    """Recreate modules whose non-persistent buffers (rotary inv_freq) are still on meta."""
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            try:
                fresh = type(mod)(config=config)
            except TypeError:
                raise UserError(f"cannot rebuild buffers of module {name} ({type(mod).__name__})") from None
            model.set_submodule(name, fresh)


def check_no_meta(model: nn.Module, where: str) -> None:
    left = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise UserError(f"{where}: tensors missing from the checkpoint: {', '.join(left[:5])}")

