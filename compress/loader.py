"""`compress.load(path, device)`: any memfit output (or plain HF dir) as a ready-to-run nn.Module."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import set_module_tensor_to_device
from torch import nn

from compress import ctformat, structured
from compress.skeleton import (
    check_no_meta,
    conv1d_as_linear,
    fix_meta_buffers,
    hf_config,
    meta_model,
)
from compress.store import WeightSource
from memfit.errors import UserError
from memfit.hf import load_pretrained
from memfit.modeldir import read_config
from memfit.runtime.embeddings import embed_scale, quant_embedding
from memfit.runtime.qlinear import quant_linear


def load(path: str | Path, device: str = "cpu", trust_remote_code: bool = False,
         backend: str | None = None) -> nn.Module:
    """Load a model dir for inference on device: our compressed-tensors output, bitsandbytes, or plain HF.

    backend forces a quantized Linear format (memfit.runtime.qlinear; "dequant": the exact fp32 reference);
    default: the fastest for the device.
    """
    path = str(path)
    src = WeightSource(path)  # validates the dir and every shard header, safetensors only
    qc = read_config(Path(path)).get("quantization_config")
    if not qc:
        return load_pretrained(path, trust_remote_code=trust_remote_code).to(device).eval()
    method = qc.get("quant_method")
    if method == "bitsandbytes":
        return load_pretrained(path, trust_remote_code=trust_remote_code, device_map={"": device}).eval()
    if method != "compressed-tensors":
        raise UserError(f"{path}: quantization method {method!r} is not supported")
    config = hf_config(path, trust_remote_code)
    model = meta_model(config, trust_remote_code)
    # gpt2: its Conv1D layers as the Linears compress wrote them (a dense one is stored [in, out]: transposed)
    transposed = conv1d_as_linear(model, config)
    dev = torch.device(device)
    filled = structured.prepare(model, src, qc, dev)  # low-rank (two Linears) and sparse-bitmask layers
    linear_names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    ours = bool(filled or (qc.get("memfit") or {}).get("lowrank"))
    per_module = ctformat.parse_config(qc, linear_names) if qc.get("config_groups") or not ours else {}
    if not per_module and not ours:
        raise UserError(f"{path}: quantization_config targets none of the model's Linear layers")
    for name, args in per_module.items():
        q = ctformat.read_quantized(src.get, name, args)
        bias = src.get(f"{name}.bias").float() if f"{name}.bias" in src else None
        model.set_submodule(name, quant_linear(q, bias, device=dev, backend=backend))
    emb = model.get_input_embeddings()  # quantized by --quantize-embeddings: rows dequantized as looked up
    emb_name = next(n for n, m in model.named_modules() if m is emb)
    if f"{emb_name}.weight_packed" in src:
        args = ctformat.parse_config(qc, [emb_name]).get(emb_name)
        if args is None:
            raise UserError(f"{path}: {emb_name} is stored quantized but no config group targets it")
        q = ctformat.read_quantized(src.get, emb_name, args)
        model.set_input_embeddings(quant_embedding(q, embed_scale(emb)).to(dev))
    for name, _p in list(model.named_parameters()):
        if name in filled:
            continue
        if name not in src and name.startswith("lm_head") and getattr(config, "tie_word_embeddings", False):
            continue
        value = src.get(name).float()
        set_module_tensor_to_device(model, name, dev, value=value.t().contiguous() if name in transposed else value)
    if getattr(config, "tie_word_embeddings", False) and "lm_head" not in per_module:
        model.tie_weights()
    fix_meta_buffers(model, config)
    model.to(dev)
    check_no_meta(model, path)
    return model.eval()
