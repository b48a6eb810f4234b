"""`compress prune` and `compress lowrank`: sparsity (magnitude, Wanda, SparseGPT) and low-rank factorization
(SVD, SVD-LLM, ASVD) of the decoder-layer Linears, layer by layer (structured.LayerWalk)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from compress import calib, lowrank, sparse_store, sparsegpt, wanda
from compress.structured import LayerWalk, compressed_tensors_config, sparsity_config
from memfit.errors import UserError
from memfit.modeldir import check_model_dir, check_output_dir

PRUNE_METHODS = {"magnitude": wanda.magnitude_layer, "wanda": wanda.wanda_layer, "sparsegpt": sparsegpt.prune_layer}
LOWRANK_METHODS = ("svd", "svd-llm", "asvd")
CALIBRATED = ("wanda", "sparsegpt", "svd-llm", "asvd")


def resolve_sparsity(sparsity: float | None, pattern: str) -> tuple[float, tuple[int, int] | None]:
    nm = sparse_store.parse_pattern(pattern)
    if nm is not None:
        implied = 1 - nm[0] / nm[1]
        if sparsity is not None and abs(sparsity - implied) > 1e-9:
            raise UserError(f"--pattern {pattern} means sparsity {implied:g}; got --sparsity {sparsity:g}")
        return implied, nm
    sparsity = 0.5 if sparsity is None else sparsity
    if not 0 < sparsity < 1:
        raise UserError(f"--sparsity must be in (0, 1), got {sparsity:g}")
    return sparsity, None


def _calibrate(walk: LayerWalk, method: str, c: dict[str, Any], trust_remote_code: bool) -> None:
    if method not in CALIBRATED:
        return
    from memfit.hf import load_tokenizer

    walk.calibrate(load_tokenizer(walk.model_dir, trust_remote_code), c["files"], c["samples"], c["seqlen"],
                   c["seed"])


def prune_model(model_dir: str, out: Path, method: str, sparsity: float | None, pattern: str, calib_opts: dict,
                skip: list[str], dense: bool = False, trust_remote_code: bool = False,
                progress: bool = True) -> dict[str, Any]:
    """Prune model_dir into out. dense=True writes a plain HF dir (zeros stored densely, for a later step)."""
    t0 = time.time()
    sparsity, nm = resolve_sparsity(sparsity, pattern)
    walk = LayerWalk(model_dir, skip, trust_remote_code)
    if nm is not None:
        bad = next((n for n, m in walk.targets.items() if m.in_features % nm[1]), None)
        if bad:
            raise UserError(f"--pattern {pattern}: M={nm[1]} does not divide in_features "
                            f"{walk.targets[bad].in_features} of {bad} (add it to --skip)")
    _calibrate(walk, method, calib_opts, trust_remote_code)
    zeros = total = 0
    for job in walk.jobs({"sparsity": sparsity, "nm": nm}, desc=f"{method} {pattern} {sparsity:g}", progress=progress):
        for n, w in PRUNE_METHODS[method](job).items():
            w16 = w.to(torch.float16)
            job.linears[n].weight.data = w16.float()  # the next layer sees exactly what is stored
            zeros, total = zeros + int((w16 == 0).sum()), total + w16.numel()
            if not dense:
                walk.tensors.update(sparse_store.tensors_for(job.prefix + n, w16))
                walk.handled.add(job.prefix + n + ".weight")
    record = {"method": method, "sparsity": sparsity, "pattern": pattern, "measured_sparsity": zeros / total,
              "skipped": walk.skipped,
              "calibration": {k: v for k, v in calib_opts.items() if k != "files"} | {"files": len(calib_opts["files"])}
              if method in CALIBRATED else None}
    if dense:
        walk.write(out, None, {"memfit_steps": [{"prune": record}]})
    else:
        sc = sparsity_config(list(walk.targets), walk.skipped, zeros / total, pattern)
        walk.write(out, compressed_tensors_config("sparse-bitmask", {**record, "prune": record}, sc))
    return {"targets": len(walk.targets), "sparsity": zeros / total, "skipped": walk.skipped,
            "seconds": time.time() - t0, "record": record}


def lowrank_model(model_dir: str, out: Path, method: str, ratio: float, calib_opts: dict, skip: list[str],
                  trust_remote_code: bool = False, progress: bool = True) -> dict[str, Any]:
    t0 = time.time()
    walk = LayerWalk(model_dir, skip, trust_remote_code)
    ranks = lowrank.check_ranks({n: (m.out_features, m.in_features) for n, m in walk.targets.items()}, ratio)
    _calibrate(walk, method, calib_opts, trust_remote_code)
    kept = orig = 0
    for job in walk.jobs({"method": method, "ranks": ranks}, desc=f"{method} ratio {ratio:g}", progress=progress):
        for n, (wu, wv) in lowrank.factorize_layer(job).items():
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
            kept, orig = kept + wu.numel() + wv.numel(), orig + mod.weight.numel()
    record = {"method": method, "ratio": ratio, "kept_params": kept, "original_params": orig,
              "lowrank": ranks, "skipped": walk.skipped,
              "calibration": {k: v for k, v in calib_opts.items() if k != "files"} | {"files": len(calib_opts["files"])}
              if method in CALIBRATED else None}
    walk.write(out, compressed_tensors_config("dense", record, None))
    return {"targets": len(ranks), "kept": kept / orig, "skipped": walk.skipped, "seconds": time.time() - t0,
            "ranks": ranks}


# ---------------------------------------------------------------- CLI


def calib_options(method: str, files_arg: list[str] | None, samples: int, seqlen: int, seed: int) -> dict[str, Any]:
    if samples <= 0 or seqlen <= 1:
        raise UserError("--calib-samples must be > 0 and --calib-seqlen > 1")
    files: list[Path] = []
    if method in CALIBRATED:
        files = calib.calibration_files(method, files_arg)
    return {"files": files, "samples": samples, "seqlen": seqlen, "seed": seed}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="input model dir (safetensors, dense)")
    p.add_argument("-o", "--output", required=True, help="output dir (refused if it exists, unless --overwrite)")
    p.add_argument("--calib", nargs="+", default=None, metavar="FILES",
                   help=f"calibration text files or dirs (default: Shakespeare training split in {calib.SHAKESPEARE})")
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--skip", default="lm_head", help="comma-separated module names/patterns left dense "
                   "(only decoder-layer Linears are ever compressed; lm_head and embeddings stay fp16)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--seed", type=int, default=0)


def add_commands(sub) -> None:
    p = sub.add_parser("prune", help="prune Linear weights (magnitude, Wanda, SparseGPT; unstructured or N:M)",
                       description="Prune the decoder-layer Linears; weights stored in the sparse-bitmask layout.")
    _common(p)
    p.add_argument("--sparsity", type=float, default=None, help="fraction of weights removed, in (0, 1) "
                   "(default 0.5; N:M patterns imply 1 - N/M)")
    p.add_argument("--method", choices=tuple(PRUNE_METHODS), default="sparsegpt")
    p.add_argument("--pattern", default="unstructured", help="unstructured (default) or N:M, e.g. 2:4, 4:8")
    p.set_defaults(func=cmd_prune)
    q = sub.add_parser("lowrank", help="factorize Linear weights into two low-rank Linears (SVD, SVD-LLM, ASVD)",
                       description="W (m x n) -> two Linears of rank k = floor(m*n*ratio/(m+n)).")
    _common(q)
    q.add_argument("--ratio", type=float, default=0.8, help="fraction of each factorized Linear's parameters kept")
    q.add_argument("--method", choices=LOWRANK_METHODS, default="svd-llm")
    q.set_defaults(func=cmd_lowrank)
    r = sub.add_parser("pipeline", help="run a recipe of steps (e.g. prune 2:4 then quantize 4-bit) into one output")
    r.add_argument("--config", required=True, help="recipe YAML (see configs/compress/)")
    r.add_argument("-o", "--output", default=None, help="output dir (default: the recipe's `output`)")
    r.add_argument("--model", default=None, help="input model dir (default: the recipe's `model`)")
    r.add_argument("--overwrite", action="store_true")
    r.set_defaults(func=cmd_pipeline)


def _skip(a) -> list[str]:
    return [s.strip() for s in a.skip.split(",") if s.strip()]


def cmd_prune(a: argparse.Namespace) -> int:
    check_model_dir(a.model)
    check_output_dir(a.model, a.output, a.overwrite)
    resolve_sparsity(a.sparsity, a.pattern)  # bad numbers before any calibration work
    c = calib_options(a.method, a.calib, a.calib_samples, a.calib_seqlen, a.seed)
    s = prune_model(a.model, Path(a.output), a.method, a.sparsity, a.pattern, c, _skip(a),
                    trust_remote_code=a.trust_remote_code)
    print(f"wrote {a.output}: {a.method} {a.pattern}, {s['targets']} Linear layers pruned to sparsity "
          f"{s['sparsity']:.4f}, skipped {', '.join(s['skipped']) or 'none'}")
    return 0


def cmd_lowrank(a: argparse.Namespace) -> int:
    check_model_dir(a.model)
    check_output_dir(a.model, a.output, a.overwrite)
    if not 0 < a.ratio <= 1:
        raise UserError(f"--ratio must be in (0, 1] (fraction of the parameters kept), got {a.ratio:g}")
    c = calib_options(a.method, a.calib, a.calib_samples, a.calib_seqlen, a.seed)
    s = lowrank_model(a.model, Path(a.output), a.method, a.ratio, c, _skip(a), trust_remote_code=a.trust_remote_code)
    print(f"wrote {a.output}: {a.method}, {s['targets']} Linear layers factorized, {s['kept']:.4f} of their "
          f"parameters kept, skipped {', '.join(s['skipped']) or 'none'}")
    return 0


def cmd_pipeline(a: argparse.Namespace) -> int:
    from compress.recipe import run_recipe

    return run_recipe(a.config, a.model, a.output, a.overwrite)
