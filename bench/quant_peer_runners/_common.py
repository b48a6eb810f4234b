"""Shared by the quantization-peer runners (each runs in its peer's own venv; see bench/quant_peers.py).

One interface: --model DIR --calib CALIB.safetensors --bits B --group-size G --out OUT [--iters N]. Each runner
loads the HF model in fp32 on CPU (safetensors, no remote code), quantizes the decoder-layer Linears only
(q/k/v/o/gate/up/down_proj; embeddings and lm_head stay fp32), and hands the dequantized weights to `write`,
which checks them against the originals and writes OUT as a plain fp32 HF dir (the input's files, with only
those weights replaced; no quantization_config) plus OUT/peer.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import resource
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj$")


def args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--asym", action="store_true", help="asymmetric groups (zero points), where the peer has them")
    return ap.parse_args()


def load_model(path: Path) -> PreTrainedModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True,
                                                 trust_remote_code=False, device_map="cpu")
    return model.eval()


def load_calib(path: Path) -> torch.Tensor:
    ids = load_file(str(path))["input_ids"]
    if ids.dtype != torch.int64 or ids.dim() != 2:
        raise ValueError(f"{path}: input_ids must be int64 [n_samples, seqlen], got {ids.dtype} {tuple(ids.shape)}")
    return ids


def decoder_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The Linears to quantize, by module name (whatever class a peer has swapped in since)."""
    found = {n: m for n, m in model.named_modules() if LINEAR.search(n)}
    if not found:
        raise RuntimeError("no decoder-layer q/k/v/o/gate/up/down_proj modules found")
    return found


def originals(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().clone() for n, m in decoder_linears(model).items()}


def start(description: str) -> tuple[argparse.Namespace, PreTrainedModel, torch.Tensor, dict[str, torch.Tensor]]:
    """What every calibrated runner begins with: its arguments, the fp32 model, the calibration ids and the
    original decoder-Linear weights (for `write`'s checks)."""
    a = args(description)
    model = load_model(a.model)
    return a, model, load_calib(a.calib), originals(model)


def version(dist: str) -> str:
    return importlib.metadata.version(dist)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Timer:
    """`with Timer() as t:` around the quantization proper; t.seconds and t.peak_rss (process peak so far) after."""

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = round(time.perf_counter() - self.t0, 3)
        self.peak_rss = peak_rss()


def check(name: str, orig: torch.Tensor, deq: torch.Tensor, bits: int, group: int) -> dict[str, Any]:
    """Assert deq is a real fake-quantization of orig: same shape, different values, at most 2**bits distinct
    values in every group of `group` consecutive weights of a row (the row length must divide by group)."""
    if deq.shape != orig.shape:
        raise AssertionError(f"{name}: dequantized shape {tuple(deq.shape)} != {tuple(orig.shape)}")
    if torch.equal(deq.float(), orig.float()):
        raise AssertionError(f"{name}: dequantized weight equals the original (a no-op quantizer)")
    if orig.shape[-1] % group:
        raise AssertionError(f"{name}: in_features {orig.shape[-1]} is not a multiple of {group}")
    groups = deq.float().reshape(-1, group)
    distinct = max(int(torch.unique(g).numel()) for g in groups)
    if distinct > 2**bits:
        raise AssertionError(f"{name}: {distinct} distinct values in a group of {group} (> 2**{bits})")
    rel = float((deq.float() - orig.float()).norm() / orig.float().norm())
    return {"layer": name, "group": group, "max_distinct_per_group": distinct, "rel_frobenius_error": round(rel, 5)}


def write(src: Path, out: Path, orig: dict[str, torch.Tensor], deq: dict[str, torch.Tensor], meta: dict[str, Any],
          check_group: int, check_layer: str | None = None) -> None:
    """OUT: src's files with each decoder-layer Linear weight replaced by its dequantized fp32 value; peer.json."""
    if set(deq) != set(orig):
        raise AssertionError(f"dequantized layers differ from the originals: {sorted(set(orig) ^ set(deq))[:6]}")
    layer = check_layer or next(n for n in orig if n.endswith("q_proj"))
    checked = check(layer, orig[layer], deq[layer], meta["bits"], check_group)
    changed = sum(not torch.equal(deq[n].float(), orig[n].float()) for n in orig)
    if changed != len(orig):
        raise AssertionError(f"only {changed} of {len(orig)} Linears changed")
    errs = {n: float((deq[n].float() - orig[n].float()).norm() / orig[n].float().norm()) for n in orig}
    todo = {f"{n}.weight": deq[n].detach().to(torch.float32).contiguous() for n in orig}
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            with safe_open(str(f), "pt") as sf:
                tensors = {k: todo.pop(k) if k in todo else sf.get_tensor(k) for k in sf.keys()}
                meta_st = sf.metadata() or {}
            save_file(tensors, str(out / f.name), metadata={**meta_st, "format": "pt"})
        elif f.is_file():
            shutil.copy2(f, out / f.name)
    if todo:
        raise AssertionError(f"{len(todo)} weights not found in {src}'s safetensors: {sorted(todo)[:4]}")
    config = json.loads((out / "config.json").read_text())
    if config.pop("quantization_config", None) is not None:
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    meta.update(check=checked, layers=len(orig), rel_frobenius_error_mean=round(sum(errs.values()) / len(errs), 5),
                rel_frobenius_error_max=round(max(errs.values()), 5),
                torch=torch.__version__, transformers=version("transformers"))
    (out / "peer.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))
