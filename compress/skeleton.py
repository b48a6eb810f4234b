"""Build a model on the meta device and fill it from a WeightSource module by module."""

from __future__ import annotations

import torch
from accelerate.utils import set_module_tensor_to_device
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.pytorch_utils import Conv1D

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
    """(name, modules) of the decoder layers: the first ModuleList of num_hidden_layers modules (model.layers,
    gpt_neox.layers, transformer.h, ...)."""
    n = getattr(config, "num_hidden_layers", None)
    if n is None and hasattr(config, "get_text_config"):
        n = getattr(config.get_text_config(), "num_hidden_layers", None)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n:
            return name, mod
    raise UserError(f"cannot find the {n} decoder layers of {type(model).__name__}")


def checkpoint_aliases(model: nn.Module, src: WeightSource) -> dict[str, str]:
    """Model parameter name -> checkpoint key, for the keys transformers renames on load (its conversion mapping:
    gpt_neox's `embed_out` is the model's `lm_head`; legacy gamma/beta; a missing base-model prefix)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    except (ImportError, AttributeError, TypeError):  # another transformers: no renaming known
        return {}
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    out = {}
    for key in src.keys():
        new, _ = rename_source_key(key, renamings, [], prefix, meta)
        if new != key and new not in src:
            out[new] = key
    return out


def conv1d_as_linear(model: nn.Module, config: PretrainedConfig) -> set[str]:
    """Replace every transformers Conv1D of the (meta) decoder layers (gpt2's c_attn / c_proj / c_fc: y = x @ W + b
    with W stored [in, out]) by an nn.Linear of the same function, so every method and format sees a Linear
    weight [out, in]. Returns the full names of the weights whose checkpoint tensors are stored transposed
    (``materialize`` reads them transposed; a layer weight written back dense is transposed back)."""
    if not any(isinstance(m, Conv1D) for m in model.modules()):
        return set()
    layers_name, layers = decoder_layers(model, config)
    names = set()
    for name, m in list(layers.named_modules()):
        if isinstance(m, Conv1D):
            in_f, out_f = m.weight.shape
            with torch.device("meta"):
                layers.set_submodule(name, nn.Linear(in_f, out_f, bias=m.bias is not None))
            names.add(f"{layers_name}.{name}.weight")
    return names


def materialize(module: nn.Module, prefix: str, src: WeightSource, dtype: torch.dtype = torch.float32,
                alias: dict[str, str] | None = None, transposed: set[str] | None = None) -> None:
    """Load every parameter (and persistent buffer) of module from src as dtype, on CPU; the full names in
    ``transposed`` (conv1d_as_linear) are stored [in, out] and read transposed."""
    for name, p in list(module.named_parameters()):
        key = prefix + name
        if key not in src and alias and key in alias:
            key = alias[key]
        value = src.get(key)
        if transposed and prefix + name in transposed:
            value = value.t().contiguous()
        if tuple(value.shape) != tuple(p.shape):
            raise UserError(f"{src.path}: tensor {key} has shape {tuple(value.shape)}, the config implies "
                            f"{tuple(p.shape)}")
        set_module_tensor_to_device(module, name, "cpu", value=value.to(dtype))
    for name, b in list(module.named_buffers()):
        if b.is_meta and prefix + name in src:
            set_module_tensor_to_device(module, name, "cpu", value=src.get(prefix + name))


def fix_meta_buffers(model: nn.Module, config: PretrainedConfig) -> None:
    """Recreate modules whose non-persistent buffers (rotary inv_freq) are still on meta; a module that cannot
    be rebuilt from the config (Gemma's scaled embedding and its embed_scale) gets them from _init_buffers."""
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            try:
                fresh = type(mod)(config=config)
            except TypeError:
                _init_buffers(model, name, mod)
                continue
            model.set_submodule(name, fresh)


def _init_buffers(model: nn.Module, name: str, mod: nn.Module) -> None:
    """Fill mod's meta buffers with the model's own _init_weights(mod), which sets non-persistent buffers in
    transformers 5; its parameters are flagged `_is_hf_initialized` meanwhile, which transformers' init
    functions respect, so the loaded weights are left alone. NaN placeholders catch a buffer it did not set."""
    init = getattr(model, "_init_weights", None)
    meta = [n for n, b in mod.named_buffers(recurse=False) if b.is_meta]
    if init is None or any(p.is_meta for p in mod.parameters(recurse=False)):
        raise UserError(f"cannot rebuild buffers of module {name} ({type(mod).__name__})")
    for n in meta:
        b = getattr(mod, n)
        setattr(mod, n, torch.full(b.shape, float("nan"), dtype=b.dtype) if b.is_floating_point()
                else torch.zeros(b.shape, dtype=b.dtype))
    params = [p for p in mod.parameters(recurse=False) if not hasattr(p, "_is_hf_initialized")]
    for p in params:
        p._is_hf_initialized = True
    try:
        with torch.no_grad():
            init(mod)
    finally:
        for p in params:
            del p._is_hf_initialized
    if any(getattr(mod, n).is_floating_point() and getattr(mod, n).isnan().any() for n in meta):
        raise UserError(f"cannot rebuild buffers of module {name} ({type(mod).__name__})")


def check_no_meta(model: nn.Module, where: str) -> None:
    left = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise UserError(f"{where}: tensors missing from the checkpoint: {', '.join(left[:5])}")

