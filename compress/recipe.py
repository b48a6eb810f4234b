"""`compress pipeline --config RECIPE.yaml`: steps in order (prune..., then lowrank or quantize), one output.

Intermediate steps write dense fp16 dirs into a work dir next to the output; the last step's dir is moved
into place with the usual temp dir + rename. A quantize step after a prune step keeps the zeros: RTN and
AWQ map 0 to the zero point anyway, and `method: gptq` runs GPTQ with the pruning mask fixed
(sparsegpt.quantize_layer, recorded as `sparse-gptq`). The output's config.json lists every step under
`memfit_steps`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from compress import pipeline, sparsegpt
from compress.prune import calib_options, lowrank_model, prune_model
from memfit.errors import UserError
from memfit.modeldir import atomic_dir, check_model_dir, check_output_dir

TOP_KEYS = {"model", "output", "calib", "calib_samples", "calib_seqlen", "seed", "steps"}
STEP_KEYS = {"prune": {"method", "sparsity", "pattern", "skip"}, "lowrank": {"method", "ratio", "skip"},
             "quantize": {"bits", "method", "group_size", "sym", "skip"}}


def load_recipe(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        r = yaml.safe_load(p.read_text())
    except OSError as e:
        raise UserError(f"--config: cannot read {p} ({e})") from None
    except yaml.YAMLError as e:
        raise UserError(f"--config {p}: not valid YAML ({e})") from None
    if not isinstance(r, dict) or not isinstance(r.get("steps"), list) or not r["steps"]:
        raise UserError(f"--config {p}: needs a non-empty `steps:` list")
    unknown = set(r) - TOP_KEYS
    if unknown:
        raise UserError(f"--config {p}: unknown keys {sorted(unknown)} (known: {sorted(TOP_KEYS)})")
    steps = []
    for i, s in enumerate(r["steps"]):
        if not isinstance(s, dict) or len(s) != 1 or next(iter(s)) not in STEP_KEYS:
            raise UserError(f"--config {p}: step {i + 1} must be one of {sorted(STEP_KEYS)} with its options")
        kind, opts = next(iter(s.items()))
        opts = opts or {}
        bad = set(opts) - STEP_KEYS[kind]
        if bad:
            raise UserError(f"--config {p}: step {i + 1} ({kind}): unknown options {sorted(bad)}")
        if kind != "prune" and i != len(r["steps"]) - 1:
            raise UserError(f"--config {p}: step {i + 1} ({kind}) must be the last step (only prune steps can "
                            "be followed by others)")
        steps.append((kind, opts))
    r["steps"] = steps
    return r


def _skip(opts: dict) -> list[str]:
    s = opts.get("skip", "lm_head")
    return [x.strip() for x in (s.split(",") if isinstance(s, str) else s) if x.strip()]


def _quantize(model_dir: str, out: Path, opts: dict, r: dict, after_prune: bool) -> dict[str, Any]:
    from compress.cli import CALIBRATED, DEFAULT_METHOD
    from memfit.hf import load_tokenizer

    bits = int(opts.get("bits", 4))
    method = opts.get("method") or DEFAULT_METHOD.get(bits)
    if method not in ("rtn", "gptq", "awq"):
        raise UserError(f"pipeline quantize: method {method!r} not supported here (rtn, gptq, awq)")
    c = calib_options("wanda" if method in CALIBRATED else "svd", r.get("calib"), r.get("calib_samples", 128),
                      r.get("calib_seqlen", 512), r.get("seed", 0))
    if after_prune and method == "gptq":
        pipeline.METHODS.setdefault("sparse-gptq", sparsegpt)
        method = "sparse-gptq"
    opt = pipeline.QuantizeOptions(bits=bits, group_size=int(opts.get("group_size", 128)), method=method,
                                   sym=bool(opts.get("sym", False)), calib_files=c["files"],
                                   calib_samples=c["samples"], calib_seqlen=c["seqlen"], skip=_skip(opts),
                                   seed=c["seed"])
    tok = load_tokenizer(model_dir) if c["files"] else None
    return pipeline.quantize(model_dir, out, opt, tok)


def run_recipe(config: str, model: str | None, output: str | None, overwrite: bool) -> int:
    r = load_recipe(config)
    model = model or r.get("model")
    output = output or r.get("output")
    if not model or not output:
        raise UserError("pipeline: give the input and output dirs (recipe `model`/`output` or --model/-o)")
    out = Path(output)
    check_model_dir(model)
    check_output_dir(model, out, overwrite)
    work = out.parent / f".{out.name}.steps-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    records: list[dict[str, Any]] = []
    try:
        cur = model
        for i, (kind, opts) in enumerate(r["steps"]):
            last = i == len(r["steps"]) - 1
            dest = work / f"step{i + 1}-{kind}"
            print(f"pipeline step {i + 1}/{len(r['steps'])}: {kind} {opts}", file=sys.stderr)
            if kind == "prune":
                method = opts.get("method", "sparsegpt")
                c = calib_options(method, r.get("calib"), r.get("calib_samples", 128), r.get("calib_seqlen", 512),
                                  r.get("seed", 0))
                s = prune_model(cur, dest, method, opts.get("sparsity"), str(opts.get("pattern", "unstructured")),
                                c, _skip(opts), dense=not last)
                records.append({"prune": s["record"]})
            elif kind == "lowrank":
                method = opts.get("method", "svd-llm")
                c = calib_options(method, r.get("calib"), r.get("calib_samples", 128), r.get("calib_seqlen", 512),
                                  r.get("seed", 0))
                s = lowrank_model(cur, dest, method, float(opts.get("ratio", 0.8)), c, _skip(opts))
                records.append({"lowrank": {"method": method, "ratio": float(opts.get("ratio", 0.8))}})
            else:
                s = _quantize(cur, dest, opts, r, after_prune=bool(records))
                records.append({"quantize": {k: v for k, v in opts.items()} | {"fallbacks": s["fallbacks"]}})
            cur = str(dest)
        cfg_path = Path(cur) / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["memfit_steps"] = records
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        atomic_dir(out, lambda tmp: shutil.copytree(cur, tmp))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}: {' -> '.join(next(iter(x)) for x in records)}")
    return 0
