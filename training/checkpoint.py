"""Crash-safe checkpoints: HF-format weights plus the full training state, all safetensors + JSON.

A checkpoint dir is written under a temp name and swapped in with renames, so a run killed during a
save leaves the previous checkpoint intact and loadable (`find_checkpoint` also finds it mid-swap).
No pickle anywhere: optimizer state is flattened into a safetensors file plus JSON metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

STATE_JSON = "training_state.json"
STATE_TENSORS = "training_state.safetensors"


def _pack(obj: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor inside nested dicts/lists by a named placeholder (bitsandbytes nests them)."""
    if torch.is_tensor(obj):
        # clone: bitsandbytes shares its quantization maps between params, and safetensors refuses aliases
        tensors[key] = obj.detach().cpu().clone()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {str(k): _pack(v, f"{key}.{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_pack(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
    return obj


def _unpack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: _unpack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v, tensors) for v in obj]
    return obj


def flatten_optimizer(sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    state = {str(idx): _pack(st, f"optimizer.{idx}", tensors) for idx, st in sd["state"].items()}
    return {"param_groups": sd["param_groups"], "state": state}, tensors


def unflatten_optimizer(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    state = {int(idx): _unpack(entry, tensors) for idx, entry in meta["state"].items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["rng.cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def find_checkpoint(dest: Path) -> Path | None:
    """The complete checkpoint at dest, or the previous one if a swap was interrupted."""
    for candidate in (dest, dest.parent / f".{dest.name}.old"):
        if (candidate / STATE_JSON).is_file():
            return candidate
    return None


def write_training_state(d: Path, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    opt_meta, tensors = flatten_optimizer(optimizer.state_dict())
    tensors.update(rng_tensors())
    save_file(tensors, str(d / STATE_TENSORS))
    # written last: its presence marks the checkpoint complete
    (d / STATE_JSON).write_text(json.dumps({**state, "optimizer": opt_meta}, indent=1))


def read_training_state(d: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    state = json.loads((d / STATE_JSON).read_text())
    tensors = load_file(str(d / STATE_TENSORS))
    return state, tensors
