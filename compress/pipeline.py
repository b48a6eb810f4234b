"""`compress quantize`: layer-by-layer quantization of a HF causal LM dir into a compressed-tensors dir.

Only one decoder layer is materialized at a time (fp32, from the safetensors shards); with calibration,
the inputs to layer 0 are captured once and each layer's *quantized* outputs feed the next layer, so
peak memory is about one decoder layer plus the calibration activations.
"""

from __future__ import annotations

import fnmatch
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from accelerate.utils import set_module_tensor_to_device
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from compress import awq, ctformat, gptq, rtn
from compress.calib import calibration_tokens
from compress.layerjob import Batch, LayerJob
from compress.quant import QuantArgs, Quantized, resolve_group_size
from compress.skeleton import decoder_layers, fix_meta_buffers, hf_config, meta_model
from compress.store import WeightSource
from memfit.errors import UserError
from memfit.modeldir import atomic_dir, copy_side_files, read_config

METHODS: dict[str, ModuleType] = {"rtn": rtn, "gptq": gptq, "awq": awq}


@dataclass
class QuantizeOptions:
    bits: int
    group_size: int
    method: str
    sym: bool
    calib_files: list[Path] = field(default_factory=list)
    calib_samples: int = 128
    calib_seqlen: int = 512
    skip: list[str] = field(default_factory=lambda: ["lm_head"])
    act_order: bool = False
    mse: bool = False  # clipping-range search per group (quant.qparams), for every method
    group_fallback: bool = True
    trust_remote_code: bool = False
    batch_size: int = 8
    seed: int = 0
    progress: bool = True


def skipped(name: str, patterns: list[str]) -> bool:
    return any(name == p or name.endswith("." + p) or fnmatch.fnmatch(name, p) for p in patterns)


class _Stop(Exception):
    pass


class _Catch(nn.Module):
    """Stands in for decoder layer 0: records its inputs, then stops the forward pass."""

    def __init__(self, store: list[Batch]) -> None:
        super().__init__()
        self.store = store

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hs = args[0] if args else kwargs.pop("hidden_states")
        self.store.append(((hs, *args[1:]), kwargs))
        raise _Stop


def capture_inputs(model: nn.Module, layers: nn.ModuleList, tokens: torch.Tensor, batch: int) -> list[Batch]:
    store: list[Batch] = []
    first = layers[0]
    layers[0] = _Catch(store)
    try:
        with torch.no_grad():
            for i in range(0, tokens.shape[0], batch):
                try:
                    model(input_ids=tokens[i : i + batch], use_cache=False)
                except _Stop:
                    pass
    finally:
        layers[0] = first
    return store


def quantize(model_dir: str, out: Path, opt: QuantizeOptions, tokenizer=None) -> dict[str, Any]:
    """Quantize model_dir into out (written atomically). Returns a summary dict."""
    t0 = time.time()
    src = WeightSource(model_dir)
    raw_cfg = read_config(Path(model_dir))
    if raw_cfg.get("quantization_config"):
        raise UserError(f"{model_dir} is already quantized ({raw_cfg['quantization_config'].get('quant_method')})")
    config = hf_config(model_dir, opt.trust_remote_code)
    model = meta_model(config, opt.trust_remote_code)
    layers_name, layers = decoder_layers(model, config)
    method = METHODS[opt.method]

    # which Linears to quantize, each with its group size (fallback noted per layer kind)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    targets: dict[str, QuantArgs] = {}
    notes: dict[str, str] = {}
    for name, m in linears.items():
        if skipped(name, opt.skip):
            continue
        g, note = resolve_group_size(name, m.in_features, opt.group_size, opt.group_fallback)
        targets[name] = QuantArgs(opt.bits, g, opt.sym, opt.mse)
        if note:
            notes[name] = note
    if not targets:
        raise UserError("nothing to quantize: every Linear is in --skip")
    kinds = {}
    for name, note in notes.items():
        kinds.setdefault(name.split(".")[-1], note)
    for kind, note in kinds.items():
        n = sum(1 for k in notes if k.endswith("." + kind) or k == kind)
        print(f"note: {note} ({n} layer(s) named *{kind})", file=sys.stderr)

    # embeddings, final norm, lm_head: loaded now (lm_head falls back to the tied embedding)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    emb_key = next((n for n, _ in model.named_parameters() if n.endswith("embed_tokens.weight")), None)
    for name, _p in [(n, p) for n, p in model.named_parameters() if not n.startswith(layers_name + ".")]:
        key = name if name in src or not (tied and name.startswith("lm_head")) else emb_key
        set_module_tensor_to_device(model, name, "cpu", value=src.get(key).float())
    if tied:
        model.tie_weights()
    fix_meta_buffers(model, config)

    inputs: list[Batch] = []
    if method.NEEDS_CALIBRATION:
        if not opt.calib_files:
            raise UserError(f"method {opt.method} needs calibration text (--calib FILES)")
        tokens = calibration_tokens(tokenizer, opt.calib_files, opt.calib_samples, opt.calib_seqlen, opt.seed)
        if int(tokens.max()) >= config.vocab_size:
            raise UserError(f"calibration tokens exceed the model's vocab_size {config.vocab_size}: wrong tokenizer?")
        inputs = capture_inputs(model, layers, tokens, opt.batch_size)

    tensors: dict[str, torch.Tensor] = {}
    quantized_names: list[str] = []
    bar = tqdm(range(len(layers)), desc=f"{opt.method} {opt.bits}-bit", unit="layer", disable=not opt.progress)
    for i in bar:
        prefix = f"{layers_name}.{i}."
        layer = layers[i]
        for pname, _p in list(layer.named_parameters()):
            set_module_tensor_to_device(layer, pname, "cpu", value=src.get(prefix + pname).float())
        lin = {n: m for n, m in layer.named_modules() if prefix + n in targets}
        job = LayerJob(layer, prefix, lin, {n: targets[prefix + n] for n in lin}, config, inputs,
                       {"act_order": opt.act_order})
        results: dict[str, Quantized] = method.quantize_layer(job)
        for n, q in results.items():
            lin[n].weight.data = q.dequantize()
            tensors.update(ctformat.tensors_for(prefix + n, q))
            quantized_names.append(prefix + n)
        qweights = {f"{n}.weight" for n in results}
        for pname, p in layer.named_parameters():
            if pname not in qweights:
                tensors[prefix + pname] = p.detach().to(torch.float16).contiguous()
        if inputs and i < len(layers) - 1:
            outs = job.run()
            inputs = [((o, *a[1:]), kw) for o, (a, kw) in zip(outs, inputs, strict=True)]
        layers[i] = layer.to("meta")

    # modules outside the decoder layers: lm_head etc. get RTN unless skipped
    untie = False
    for name, m in linears.items():
        if name in targets and not name.startswith(layers_name + "."):
            q = rtn.rtn(m.weight.data, targets[name])
            tensors.update(ctformat.tensors_for(name, q))
            quantized_names.append(name)
            untie = untie or (tied and name.startswith("lm_head"))
    qweights = {f"{n}.weight" for n in quantized_names}
    for name, p in model.named_parameters(remove_duplicate=not untie):
        if not name.startswith(layers_name + ".") and name not in qweights:
            tensors[name] = p.detach().to(torch.float16).contiguous()

    skipped_names = sorted(n for n in linears if n not in targets)
    memfit = {"method": opt.method, "bits": opt.bits, "group_size": opt.group_size, "symmetric": opt.sym,
              "act_order": opt.act_order, "mse_clip": opt.mse, "skipped": skipped_names,
              "group_size_fallbacks": {n: targets[n].group_size for n in notes},
              "calibration": {"files": len(opt.calib_files), "samples": opt.calib_samples,
                              "seqlen": opt.calib_seqlen} if method.NEEDS_CALIBRATION else None}
    cfg = dict(raw_cfg)
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "float16"
    if untie:
        cfg["tie_word_embeddings"] = False
    cfg["quantization_config"] = ctformat.quantization_config({n: targets[n] for n in quantized_names}, memfit)

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        copy_side_files(Path(model_dir), tmp)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    atomic_dir(out, write)
    return {"quantized": len(quantized_names), "skipped": skipped_names, "seconds": time.time() - t0,
            "fallbacks": memfit["group_size_fallbacks"]}
