"""Layer-by-layer driver and on-disk format shared by `compress prune` and `compress lowrank`.

Like `compress quantize`, one decoder layer is materialized at a time (fp32, from the shards); with
calibration, the inputs of layer 0 are captured once and each layer's *compressed* outputs feed the next.
Only Linears inside the decoder layers are targets (lm_head and the embeddings stay dense fp16).

Output dirs (fp16, written to a temp dir and renamed): config.json gets a compressed-tensors style
`quantization_config` with `memfit` holding the method and, for low-rank, `lowrank: {module: rank}`
(module stored as `module.0.weight` (k, in) and `module.1.weight` (out, k): two Linears). Pruned Linears
use the `sparse-bitmask` layout (sparse_store.py), listed in `sparsity_config.targets`.
`prepare()` is the loader's side: it swaps in the two-Linear modules and decompresses sparse weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_module_tensor_to_device
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from compress import sparse_store
from compress.calib import calibration_tokens
from compress.ctformat import FORMAT_VERSION
from compress.layerjob import LayerJob
from compress.pipeline import capture_inputs, skipped
from compress.skeleton import decoder_layers, fix_meta_buffers, hf_config, materialize, meta_model
from compress.store import WeightSource
from memfit.errors import UserError
from memfit.modeldir import atomic_dir, copy_side_files, read_config


class LayerWalk:
    """A model dir on the meta device with its outer modules loaded; iterate to get one LayerJob per layer.

    While a layer is current, the caller rewrites its target Linears (their weight feeds the next layer) and
    puts their stored form into `tensors`, naming the handled parameters in `handled`; every other parameter
    of the layer is stored as fp16 when the walk moves on.
    """

    def __init__(self, model_dir: str, skip: list[str], trust_remote_code: bool = False) -> None:
        self.model_dir = model_dir
        self.src = WeightSource(model_dir)
        self.raw_cfg = read_config(Path(model_dir))
        if self.raw_cfg.get("quantization_config"):
            qc = self.raw_cfg["quantization_config"]
            raise UserError(f"{model_dir} is already compressed ({qc.get('quant_method')}): start from a dense model")
        self.config = hf_config(model_dir, trust_remote_code)
        self.model = meta_model(self.config, trust_remote_code)
        self.layers_name, self.layers = decoder_layers(self.model, self.config)
        linears = {n: m for n, m in self.model.named_modules() if isinstance(m, nn.Linear)}
        inner = self.layers_name + "."
        self.targets = {n: m for n, m in linears.items() if n.startswith(inner) and not skipped(n, skip)}
        self.skipped = sorted(n for n in linears if n not in self.targets)
        if not self.targets:
            raise UserError("nothing to compress: every decoder-layer Linear is in --skip")
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        emb = next((n for n, _ in self.model.named_parameters() if n.endswith("embed_tokens.weight")), None)
        for name, _p in [(n, p) for n, p in self.model.named_parameters() if not n.startswith(inner)]:
            key = name if name in self.src or not (tied and name.startswith("lm_head")) else emb
            set_module_tensor_to_device(self.model, name, "cpu", value=self.src.get(key).float())
        if tied:
            self.model.tie_weights()
        fix_meta_buffers(self.model, self.config)
        self.inputs: list = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.handled: set[str] = set()

    def calibrate(self, tokenizer, files: list[Path], samples: int, seqlen: int, seed: int, batch: int = 8) -> None:
        if not files:
            raise UserError("calibration text needed (--calib FILES)")
        tokens = calibration_tokens(tokenizer, files, samples, seqlen, seed)
        if int(tokens.max()) >= self.config.vocab_size:
            raise UserError(f"calibration tokens exceed the model's vocab_size {self.config.vocab_size}: "
                            "wrong tokenizer?")
        self.inputs = capture_inputs(self.model, self.layers, tokens, batch)

    def jobs(self, options: dict[str, Any], desc: str, progress: bool = True):
        for i in tqdm(range(len(self.layers)), desc=desc, unit="layer", disable=not progress):
            prefix = f"{self.layers_name}.{i}."
            layer = self.layers[i]
            materialize(layer, prefix, self.src)
            lin = {n: m for n, m in layer.named_modules() if prefix + n in self.targets}
            job = LayerJob(layer, prefix, lin, {}, self.config, self.inputs, options)
            yield job
            for pname, p in layer.named_parameters():
                if prefix + pname not in self.handled:
                    self.tensors[prefix + pname] = p.detach().to(torch.float16).contiguous()
            if self.inputs and i < len(self.layers) - 1:
                outs = job.run()
                self.inputs = [((o, *a[1:]), kw) for o, (a, kw) in zip(outs, self.inputs, strict=True)]
            self.layers[i] = layer.to("meta")
        self.inputs = []

    def write(self, out: Path, qc: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> None:
        inner = self.layers_name + "."
        for name, p in self.model.named_parameters():
            if not name.startswith(inner):
                self.tensors[name] = p.detach().to(torch.float16).contiguous()
        cfg = dict(self.raw_cfg)
        cfg.pop("torch_dtype", None)
        cfg["dtype"] = "float16"
        if qc:
            cfg["quantization_config"] = qc
        cfg.update(extra or {})

        def write(tmp: Path) -> None:
            tmp.mkdir(parents=True)
            save_file(self.tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            copy_side_files(Path(self.model_dir), tmp)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

        atomic_dir(out, write)


def compressed_tensors_config(fmt: str, memfit: dict[str, Any], sparsity: dict[str, Any] | None) -> dict[str, Any]:
    qc: dict[str, Any] = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                          "config_groups": {}, "ignore": sorted(memfit.get("skipped", [])), "kv_cache_scheme": None,
                          "memfit": {"format_version": FORMAT_VERSION, "bits": 16, **memfit}}
    if sparsity:
        qc["sparsity_config"] = sparsity
    return qc


def sparsity_config(targets: list[str], skipped_names: list[str], global_sparsity: float, pattern: str,
                    fmt: str = "sparse-bitmask") -> dict[str, Any]:
    return {"format": fmt, "global_sparsity": round(global_sparsity, 6), "sparsity_structure": pattern,
            "targets": sorted(targets), "ignore": sorted(skipped_names), "registry_requires_subclass": False}


def prepare(model: nn.Module, src: WeightSource, qc: dict[str, Any], device: torch.device) -> set[str]:
    """Loader hook: two-Linear modules for low-rank layers, dense weights for sparse-bitmask ones.

    Returns the parameter names it filled (the caller loads every other parameter by name).
    """
    memfit = qc.get("memfit") or {}
    for name, rank in (memfit.get("lowrank") or {}).items():
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear):
            raise UserError(f"lowrank: {name} is not a Linear in this model")
        with torch.device("meta"):
            new = nn.Sequential(nn.Linear(old.in_features, int(rank), bias=False),
                                nn.Linear(int(rank), old.out_features, bias=old.bias is not None))
        model.set_submodule(name, new)
    filled: set[str] = set()
    for name in (qc.get("sparsity_config") or {}).get("targets", []):
        if sparse_store.has_sparse(src, name):
            set_module_tensor_to_device(model, f"{name}.weight", device, value=sparse_store.read_sparse(src.get, name))
            filled.add(f"{name}.weight")
    return filled
