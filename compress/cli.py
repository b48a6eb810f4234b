"""`compress` CLI: quantize, prune, lowrank, pipeline, eval, info, export (GGUF). Bad input -> message on stderr
and exit 2.

Method choices, defaults and what a command loads (calibration text, a tokenizer) come from the method
registry (methods.py); the work is done by quantize.py, prune.py, recipe.py and gguf_export.py, which never
import this. `quantize --max-size/--target-bits` (a size budget) chooses per-module widths in budget.py first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from compress import bnb, budget, calib, gguf_export, methods
from compress.calib import Calibration, check_sizes
from compress.evaluate import EVAL_SEQLEN, decode_speed, describe, format_table, perplexity
from compress.loader import load
from compress.lowrank import check_ratio
from compress.prune import lowrank_model, prune_model, resolve_sparsity
from compress.quant import SUPPORTED_BITS
from compress.quantize import QuantizeOptions, quantize_model
from compress.recipe import run_recipe
from memfit.defaults import CALIB_SAMPLES, CALIB_SEQLEN, GROUP_SIZE
from memfit.errors import UserError
from memfit.modeldir import check_model_dir, check_output_dir


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would exit itself; we want main() to return 2
        raise UserError(f"{self.prog}: {message}")


def _calib_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calib", nargs="+", default=None, metavar="FILES",
                   help="calibration text files or dirs (default: Shakespeare training split in "
                   f"{calib.SHAKESPEARE}, all but the held-out plays); only calibrated methods read it")
    p.add_argument("--calib-samples", type=int, default=CALIB_SAMPLES)
    p.add_argument("--calib-seqlen", type=int, default=CALIB_SEQLEN)


def _methods_help(kind: methods.Kind) -> str:
    return "; ".join(f"{m.name}: {m.summary}{' (calibrated)' if m.calibrated else ''}"
                     for m in methods.METHODS.values() if m.kind == kind and m.listed)


def _add_quantize(sub) -> None:
    defaults = ", ".join(f"{b}-bit: {m}" for b, m in methods.DEFAULT_QUANTIZE.items())
    p = sub.add_parser("quantize", help="quantize a model dir", description="Quantize a Hugging Face causal LM dir "
                       "layer by layer into a compressed-tensors (pack-quantized) dir; nf4/int8 use bitsandbytes.")
    p.add_argument("model", help="input model dir (safetensors)")
    p.add_argument("-o", "--output", required=True, help="output dir (refused if it exists, unless --overwrite)")
    p.add_argument("--bits", type=int, default=None, choices=SUPPORTED_BITS, help="bits per weight (default 4; "
                   "not with a size budget, which chooses them)")
    p.add_argument("--group-size", type=int, default=GROUP_SIZE, help=f"input columns per scale (default "
                   f"{GROUP_SIZE}); layers it does not divide get the largest divisor (noted), unless "
                   "--no-group-fallback")
    p.add_argument("--no-group-fallback", action="store_true", help="refuse layers the group size does not divide")
    p.add_argument("--method", choices=methods.names("quantize"), default=None,
                   help=f"{_methods_help('quantize')}. Default: the best measured at that width ({defaults})")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=None, help="symmetric (no zero points)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric (default)")
    _calib_flags(p)
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True, help="gptq: quantize "
                   "columns by decreasing Hessian diagonal, with static groups (default on)")
    p.add_argument("--mse-clip", action=argparse.BooleanOptionalAction, default=None, help="rtn/gptq/awq: per "
                   "group, shrink the range to the clipping that minimises the weight error (GPTQ's mse option); "
                   "default on for gptq, off for rtn (it raised RTN's KL on Gemma 3 270M) and awq (it searches "
                   "its own)")
    p.add_argument("--skip", default=None, help="comma-separated module names/patterns kept in fp16 "
                   "(default lm_head, none with a size budget or --quantize-embeddings; '' quantizes everything)")
    p.add_argument("--quantize-embeddings", choices=["int8", "int4"], default=None, help="also store the input "
                   "embedding and lm_head quantized (RTN; untied where tied): int8 one scale per row, int4 groups "
                   "of 32 (far more quality lost: bench/results/embeddings.md). The output loads with memfit "
                   "(compress.load, serve), not with transformers' own loader")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    budget.add_flags(p)
    p.set_defaults(func=cmd_quantize)


def _skip(a: argparse.Namespace, default: str = "lm_head") -> list[str]:
    return [s.strip() for s in (default if a.skip is None else a.skip).split(",") if s.strip()]


def _check_dirs(a: argparse.Namespace) -> None:
    check_model_dir(a.model)  # no weights / pickle-only: refused before any work
    check_output_dir(a.model, a.output, a.overwrite)


def _calibration(a: argparse.Namespace, method: methods.Method) -> Calibration | None:
    """The calibration the method needs (the registry says whether), or None: no files, no tokenizer."""
    check_sizes(a.calib_samples, a.calib_seqlen)
    return method.calibration(a.calib, a.calib_samples, a.calib_seqlen, a.seed)


def cmd_quantize(a: argparse.Namespace) -> int:
    out = Path(a.output)
    sized = a.max_size is not None or a.target_bits is not None
    if sized and a.bits is not None:
        raise UserError("--bits cannot be combined with --max-size/--target-bits: the budget chooses the widths")
    a.bits = a.bits or 4
    method = methods.get(a.method or methods.default("quantize", a.bits), "quantize")
    if sized and a.quantize_embeddings:
        raise UserError("--quantize-embeddings cannot be combined with --max-size/--target-bits: the budget chooses "
                        "lm_head's width itself")
    if sized and method.layer is None:
        raise UserError(f"--max-size/--target-bits: method {method.name} is bitsandbytes' single fixed format; a "
                        "size budget needs a layer-by-layer method (rtn, gptq, awq)")
    if a.quantize_embeddings and method.layer is None:
        raise UserError(f"--quantize-embeddings: method {method.name} is bitsandbytes' fixed format; use rtn, "
                        "gptq or awq")
    _check_dirs(a)
    if a.group_size <= 0:
        raise UserError(f"--group-size must be positive, got {a.group_size}")
    skip, per_module, record = _skip(a, "" if sized or a.quantize_embeddings else "lm_head"), None, None
    if sized:  # before the calibration: a budget below the smallest size is refused without any work
        per_module, skip, record = budget.plan(a, skip)
    cal = _calibration(a, method)
    if method.layer is None:  # bitsandbytes: the whole model at load time
        summary = bnb.quantize(a.model, out, method.name, a.bits, skip, a.trust_remote_code)
    else:
        opt = QuantizeOptions(bits=a.bits, method=method.name, group_size=a.group_size, sym=bool(a.sym),
                              calibration=cal, skip=skip, act_order=a.act_order, mse=a.mse_clip,
                              group_fallback=not a.no_group_fallback, trust_remote_code=a.trust_remote_code,
                              bits_per_module=per_module, record=record, embeddings=a.quantize_embeddings)
        summary = quantize_model(a.model, out, opt)
        if a.quantize_embeddings:
            print("note: --quantize-embeddings: load the output with memfit (compress.load, serve); transformers' "
                  "own from_pretrained cannot build a quantized nn.Embedding yet", file=sys.stderr)
    print(f"wrote {out}: {method.name} {'mixed' if sized else a.bits}-bit, {summary['quantized']} Linear layers "
          f"quantized, skipped {', '.join(summary['skipped']) or 'none'}")
    return 0


def _compress_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="input model dir (safetensors, dense)")
    p.add_argument("-o", "--output", required=True, help="output dir (refused if it exists, unless --overwrite)")
    _calib_flags(p)
    p.add_argument("--skip", default="lm_head", help="comma-separated module names/patterns left dense "
                   "(only decoder-layer Linears are ever compressed; lm_head and embeddings stay fp16)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--seed", type=int, default=0)


def _add_prune_lowrank_pipeline(sub) -> None:
    p = sub.add_parser("prune", help="prune Linear weights (magnitude, Wanda, SparseGPT; unstructured or N:M)",
                       description="Prune the decoder-layer Linears; weights stored in the sparse-bitmask layout.")
    _compress_common(p)
    p.add_argument("--sparsity", type=float, default=None, help="fraction of weights removed, in (0, 1) "
                   "(default 0.5; N:M patterns imply 1 - N/M)")
    p.add_argument("--method", choices=methods.names("prune"), default=methods.default("prune"),
                   help=_methods_help("prune"))
    p.add_argument("--pattern", default="unstructured", help="unstructured (default) or N:M, e.g. 2:4, 4:8")
    p.set_defaults(func=cmd_prune)
    q = sub.add_parser("lowrank", help="factorize Linear weights into two low-rank Linears (SVD, SVD-LLM, ASVD)",
                       description="W (m x n) -> two Linears of rank k = floor(m*n*ratio/(m+n)).")
    _compress_common(q)
    q.add_argument("--ratio", type=float, default=0.8, help="fraction of each factorized Linear's parameters kept")
    q.add_argument("--method", choices=methods.names("lowrank"), default=methods.default("lowrank"),
                   help=_methods_help("lowrank"))
    q.set_defaults(func=cmd_lowrank)
    r = sub.add_parser("pipeline", help="run a recipe of steps (e.g. prune 2:4 then quantize 4-bit) into one output")
    r.add_argument("--config", required=True, help="recipe YAML (see configs/compress/)")
    r.add_argument("-o", "--output", default=None, help="output dir (default: the recipe's `output`)")
    r.add_argument("--model", default=None, help="input model dir (default: the recipe's `model`)")
    r.add_argument("--overwrite", action="store_true")
    r.set_defaults(func=lambda a: run_recipe(a.config, a.model, a.output, a.overwrite))


def cmd_prune(a: argparse.Namespace) -> int:
    method = methods.get(a.method, "prune")
    _check_dirs(a)
    resolve_sparsity(a.sparsity, a.pattern)  # bad numbers before any calibration work
    s = prune_model(a.model, Path(a.output), a.method, a.sparsity, a.pattern, _calibration(a, method), _skip(a),
                    trust_remote_code=a.trust_remote_code)
    print(f"wrote {a.output}: {a.method} {a.pattern}, {s['targets']} Linear layers pruned to sparsity "
          f"{s['sparsity']:.4f}, skipped {', '.join(s['skipped']) or 'none'}")
    return 0


def cmd_lowrank(a: argparse.Namespace) -> int:
    method = methods.get(a.method, "lowrank")
    _check_dirs(a)
    check_ratio(a.ratio)
    s = lowrank_model(a.model, Path(a.output), a.method, a.ratio, _calibration(a, method), _skip(a),
                      trust_remote_code=a.trust_remote_code)
    print(f"wrote {a.output}: {a.method}, {s['targets']} Linear layers factorized, {s['kept']:.4f} of their "
          f"parameters kept, skipped {', '.join(s['skipped']) or 'none'}")
    return 0


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="perplexity, size on disk and decode speed, side by side with baselines")
    p.add_argument("model")
    p.add_argument("--baseline", nargs="*", default=[], help="model dir(s) to compare against")
    p.add_argument("--text", nargs="+", default=None, metavar="FILES",
                   help=f"evaluation text (default: held-out plays {', '.join(calib.HELD_OUT)})")
    p.add_argument("--seqlen", type=int, default=EVAL_SEQLEN, help="tokens per perplexity window")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate at most this many tokens")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated for the speed measure (0: skip)")
    p.add_argument("--decode-engine", choices=["auto", "serve", "hf"], default="auto",
                   help="decode loop for the speed measure: serve's static-cache engine (what `serve` runs), "
                        "transformers' own forward (hf), or auto: serve where it supports the architecture")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_eval)


def evaluate_dirs(paths: list[str], files: list[Path], seqlen: int, max_tokens: int | None, decode_tokens: int,
                  device: str = "cpu", decode_engine: str = "auto") -> list[dict]:
    from memfit.hf import load_tokenizer

    rows = []
    tokens, bos = None, None
    for p in paths:
        info = describe(p)
        if tokens is None:
            tok = load_tokenizer(p)
            tokens, bos = calib.eval_tokens(tok, files, max_tokens), calib.bos_id(tok)
        model = load(p, device=device)
        if int(tokens.max()) >= model.config.vocab_size:
            raise UserError(f"{p}: evaluation tokens exceed vocab_size; models must share a tokenizer")
        row = {"model": p, "method": info["method"] if info["quant_method"] != "none" else "fp",
               "bits": info["bits"], "ppl": perplexity(model, tokens, seqlen, bos=bos),
               "size_MiB": info["weights_bytes"] / 2**20}
        engine = decode_engine
        if engine == "auto":
            from memfit.runtime.slot_model import SUPPORTED_TYPES

            engine = "serve" if getattr(model.config, "model_type", None) in SUPPORTED_TYPES else "hf"
        row["tok_s"] = decode_speed(model, decode_tokens, engine=engine) if decode_tokens > 0 else float("nan")
        row["engine"] = engine
        rows.append(row)
        del model
    return rows


def cmd_eval(a: argparse.Namespace) -> int:
    files = calib.expand(a.text, "--text") if a.text else calib.default_eval_files()
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise UserError(f"--text: {missing[0]} not found (fetch the default with python -m training.shakespeare)")
    torch.manual_seed(0)
    rows = evaluate_dirs([*a.baseline, a.model], files, a.seqlen, a.max_tokens, a.decode_tokens, a.device,
                         a.decode_engine)
    base = dict(rows[0])
    for r in rows:
        r["ppl_x"] = f"{r['ppl'] / base['ppl']:.3f}"
        r["size_x"] = f"{r['size_MiB'] / base['size_MiB']:.3f}"
        r["speed_x"] = f"{r['tok_s'] / base['tok_s']:.2f}" if a.decode_tokens > 0 else "-"
        r["ppl"], r["size_MiB"], r["tok_s"] = f"{r['ppl']:.3f}", f"{r['size_MiB']:.2f}", f"{r['tok_s']:.1f}"
    print(format_table(rows, ["model", "method", "bits", "ppl", "ppl_x", "size_MiB", "size_x", "tok_s", "speed_x",
                                "engine"]))
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    info = describe(a.model)
    for k, v in info.items():
        if k == "skipped":
            v = ", ".join(v) or "none"
        print(f"{k:>22}: {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="compress", description="memfit compress: quantize models to fewer bits, evaluate, inspect.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_quantize(sub)
    _add_eval(sub)
    _add_prune_lowrank_pipeline(sub)
    gguf_export.add_parser(sub)
    i = sub.add_parser("info", help="summary of a model dir (config, quantization, tensors, size)")
    i.add_argument("model")
    i.set_defaults(func=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except UserError as e:
        print(f"compress: error: {e}", file=sys.stderr)
        return 2


def entry() -> None:
    sys.exit(main())
