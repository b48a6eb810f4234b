"""On-disk format of `compress prune` / `compress lowrank` outputs, and the loader's side of it.

Output dirs are fp16 (written by walk.LayerWalk): config.json gets a compressed-tensors style
`quantization_config` with `memfit` holding the method and, for low-rank, `lowrank: {module: rank}`
(module stored as `module.0.weight` (k, in) and `module.1.weight` (out, k): two Linears). Pruned Linears
use the `sparse-bitmask` layout (sparse_store.py), listed in `sparsity_config.targets`.
`prepare()` is the loader's side: it swaps in the two-Linear modules and decompresses sparse weights.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import set_module_tensor_to_device
from torch import nn

from compress import sparse_store
from compress.ctformat import FORMAT_VERSION
from compress.store import WeightSource
from memfit.errors import UserError


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
