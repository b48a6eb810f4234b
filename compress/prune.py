"""`compress prune` and `compress lowrank` (and their recipe steps): sparsity (magnitude, Wanda, SparseGPT)
and low-rank factorization (SVD, SVD-LLM, ASVD) of the decoder-layer Linears, through the one layer walk.

Pruned Linears are stored in the sparse-bitmask layout (sparse_store.py), or densely (dense=True) when a later
recipe step reads them; factorized ones as two Linears. The formats are described in structured.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from compress import lowrank, methods, sparse_store
from compress.calib import Calibration
from compress.layerjob import LayerJob
from compress.structured import compressed_tensors_config, sparsity_config
from compress.walk import LayerWalk
from memfit.errors import UserError


def resolve_sparsity(sparsity: float | None, pattern: str,
                     names: tuple[str, str] = ("--sparsity", "--pattern")) -> tuple[float, tuple[int, int] | None]:
    """(sparsity, N:M or None); names: the flags (or recipe keys) a refusal names."""
    nm = sparse_store.parse_pattern(pattern, names[1])
    if nm is not None:
        implied = 1 - nm[0] / nm[1]
        if sparsity is not None and abs(sparsity - implied) > 1e-9:
            raise UserError(f"{names[1]} {pattern} means sparsity {implied:g}; got {names[0]} {sparsity:g}")
        return implied, nm
    sparsity = 0.5 if sparsity is None else sparsity
    if not 0 < sparsity < 1:
        raise UserError(f"{names[0]} must be in (0, 1), got {sparsity:g}")
    return sparsity, None


def prune_model(model_dir: str, out: Path, method: str, sparsity: float | None, pattern: str,
                calibration: Calibration | None, skip: list[str], dense: bool = False,
                trust_remote_code: bool = False, progress: bool = True) -> dict[str, Any]:
    """Prune model_dir into out. dense=True writes a plain HF dir (zeros stored densely, for a later step)."""
    t0 = time.time()
    m = methods.get(method, "prune")
    sparsity, nm = resolve_sparsity(sparsity, pattern)
    walk = LayerWalk(model_dir, skip, trust_remote_code)
    if nm is not None:
        bad = next((n for n, lin in walk.targets.items() if lin.in_features % nm[1]), None)
        if bad:
            raise UserError(f"--pattern {pattern}: M={nm[1]} does not divide in_features "
                            f"{walk.targets[bad].in_features} of {bad} (add it to --skip)")
    walk.calibrate(m, calibration)
    count = {"zeros": 0, "total": 0}

    def store(job: LayerJob, results: dict[str, torch.Tensor]) -> None:
        for n, w in results.items():
            w16 = w.to(torch.float16)
            job.linears[n].weight.data = w16.float()  # the next layer sees exactly what is stored
            count["zeros"] += int((w16 == 0).sum())
            count["total"] += w16.numel()
            if not dense:
                walk.tensors.update(sparse_store.tensors_for(job.prefix + n, w16))
                walk.handled.add(job.prefix + n + ".weight")

    walk.run(m, store, {"sparsity": sparsity, "nm": nm}, desc=f"{method} {pattern} {sparsity:g}", progress=progress)
    measured = count["zeros"] / count["total"]
    record = {"method": method, "sparsity": sparsity, "pattern": pattern, "measured_sparsity": measured,
              "skipped": walk.skipped, "calibration": calibration.record() if m.calibrated and calibration else None}
    if dense:
        walk.write(out, None, {"memfit_steps": [{"prune": record}]})
    else:
        sc = sparsity_config(list(walk.targets), walk.skipped, measured, pattern)
        walk.write(out, compressed_tensors_config("sparse-bitmask", {**record, "prune": record}, sc))
    return {"targets": len(walk.targets), "sparsity": measured, "skipped": walk.skipped,
            "seconds": time.time() - t0, "record": record}


def lowrank_model(model_dir: str, out: Path, method: str, ratio: float, calibration: Calibration | None,
                  skip: list[str], trust_remote_code: bool = False, progress: bool = True) -> dict[str, Any]:
    """Factorize model_dir's decoder-layer Linears into two Linears each, keeping `ratio` of their parameters."""
    t0 = time.time()
    m = methods.get(method, "lowrank")
    lowrank.check_ratio(ratio)
    walk = LayerWalk(model_dir, skip, trust_remote_code)
    ranks = lowrank.check_ranks({n: (lin.out_features, lin.in_features) for n, lin in walk.targets.items()}, ratio)
    walk.calibrate(m, calibration)
    count = {"kept": 0, "orig": 0}

    def store(job: LayerJob, results: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for n, (wu, wv) in results.items():
            wu, wv = wu.to(torch.float16), wv.to(torch.float16)
            mod = job.linears[n]
            mod.weight.data = wu.float() @ wv.float()
            name = job.prefix + n
            walk.tensors[f"{name}.0.weight"] = wv.contiguous()
            walk.tensors[f"{name}.1.weight"] = wu.contiguous()
            walk.handled.add(f"{name}.weight")
            if mod.bias is not None:
                walk.tensors[f"{name}.1.bias"] = mod.bias.detach().to(torch.float16)
                walk.handled.add(f"{name}.bias")
            count["kept"] += wu.numel() + wv.numel()
            count["orig"] += mod.weight.numel()

    walk.run(m, store, {"method": method, "ranks": ranks}, desc=f"{method} ratio {ratio:g}", progress=progress)
    kept, orig = count["kept"], count["orig"]
    record = {"method": method, "ratio": ratio, "kept_params": kept, "original_params": orig,
              "lowrank": ranks, "skipped": walk.skipped,
              "calibration": calibration.record() if m.calibrated and calibration else None}
    walk.write(out, compressed_tensors_config("dense", record, None))
    return {"targets": len(ranks), "kept": kept / orig, "skipped": walk.skipped, "seconds": time.time() - t0,
            "ranks": ranks}
