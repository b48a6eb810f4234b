"""`compress` CLI: quantize, eval, info. Bad input -> message on stderr and exit code 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from compress import calib
from compress.evaluate import decode_speed, describe, format_table, perplexity
from compress.quant import SUPPORTED_BITS
from memfit.errors import UserError
from memfit.modeldir import check_model_dir, check_output_dir

# Best measured method per width on models/shakespeare-llama (bench/results/quantize.md).
DEFAULT_METHOD = {2: "gptq", 3: "gptq", 4: "gptq", 8: "rtn"}
CALIBRATED = ("gptq", "awq")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would exit itself; we want main() to return 2
        raise UserError(f"{self.prog}: {message}")


def _add_quantize(sub) -> None:
    defaults = ", ".join(f"{b}-bit: {m}" for b, m in DEFAULT_METHOD.items())
    p = sub.add_parser("quantize", help="quantize a model dir", description="Quantize a Hugging Face causal LM dir "
                       "layer by layer into a compressed-tensors (pack-quantized) dir; nf4/int8 use bitsandbytes.")
    p.add_argument("model", help="input model dir (safetensors)")
    p.add_argument("-o", "--output", required=True, help="output dir (refused if it exists, unless --overwrite)")
    p.add_argument("--bits", type=int, default=4, choices=SUPPORTED_BITS, help="bits per weight (default 4)")
    p.add_argument("--group-size", type=int, default=128, help="input columns per scale (default 128); layers it "
                   "does not divide get the largest divisor (noted), unless --no-group-fallback")
    p.add_argument("--no-group-fallback", action="store_true", help="refuse layers the group size does not divide")
    p.add_argument("--method", choices=("rtn", "gptq", "awq", "nf4", "int8"), default=None,
                   help=f"default: the best measured at that width ({defaults})")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=None, help="symmetric (no zero points)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric (default)")
    p.add_argument("--calib", nargs="+", default=None, metavar="FILES",
                   help="calibration text files or dirs for gptq/awq (default: Shakespeare training split in "
                   f"{calib.SHAKESPEARE}, all but the held-out plays)")
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--act-order", action="store_true", help="gptq: quantize columns by decreasing Hessian diagonal")
    p.add_argument("--mse-clip", action="store_true", help="rtn/gptq/awq: per group, shrink the range to the "
                   "clipping that minimises the weight error (GPTQ's mse option); off by default, as in GPTQModel")
    p.add_argument("--skip", default="lm_head", help="comma-separated module names/patterns kept in fp16 "
                   "(default lm_head; '' quantizes everything)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(a: argparse.Namespace) -> int:
    from compress import bnb, pipeline
    from memfit.hf import load_tokenizer

    out = Path(a.output)
    model = Path(a.model)
    check_model_dir(model)  # no weights / pickle-only: refused before any work
    check_output_dir(model, out, a.overwrite)
    if a.group_size <= 0:
        raise UserError(f"--group-size must be positive, got {a.group_size}")
    if a.calib_samples <= 0 or a.calib_seqlen <= 1:
        raise UserError("--calib-samples must be > 0 and --calib-seqlen > 1")
    method = a.method or DEFAULT_METHOD[a.bits]
    skip = [s.strip() for s in a.skip.split(",") if s.strip()]
    if method in ("nf4", "int8"):
        summary = bnb.quantize(str(model), out, method, a.bits, skip, a.trust_remote_code)
    else:
        files: list[Path] = []
        tok = None
        if method in CALIBRATED:
            files = calib.calibration_files(method, a.calib)
            tok = load_tokenizer(str(model), a.trust_remote_code)
        opt = pipeline.QuantizeOptions(
            bits=a.bits, group_size=a.group_size, method=method, sym=bool(a.sym), calib_files=files,
            calib_samples=a.calib_samples, calib_seqlen=a.calib_seqlen, skip=skip,
            act_order=a.act_order, mse=a.mse_clip,
            group_fallback=not a.no_group_fallback, trust_remote_code=a.trust_remote_code, seed=a.seed)
        summary = pipeline.quantize(str(model), out, opt, tok)
    print(f"wrote {out}: {method} {a.bits}-bit, {summary['quantized']} Linear layers quantized, "
          f"skipped {', '.join(summary['skipped']) or 'none'}")
    return 0


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="perplexity, size on disk and decode speed, side by side with baselines")
    p.add_argument("model")
    p.add_argument("--baseline", nargs="*", default=[], help="model dir(s) to compare against")
    p.add_argument("--text", nargs="+", default=None, metavar="FILES",
                   help=f"evaluation text (default: held-out plays {', '.join(calib.HELD_OUT)})")
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate at most this many tokens")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated for the speed measure (0: skip)")
    p.add_argument("--decode-engine", choices=["auto", "serve", "hf"], default="auto",
                   help="decode loop for the speed measure: serve's static-cache engine (what `serve` runs), "
                        "transformers' own forward (hf), or auto: serve where it supports the architecture")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_eval)


def evaluate_dirs(paths: list[str], files: list[Path], seqlen: int, max_tokens: int | None, decode_tokens: int,
                  device: str = "cpu", decode_engine: str = "auto") -> list[dict]:
    import compress
    from memfit.hf import load_tokenizer

    rows = []
    tokens = None
    for p in paths:
        info = describe(p)
        if tokens is None:
            tokens = calib.eval_tokens(load_tokenizer(p), files, max_tokens)
        model = compress.load(p, device=device)
        if int(tokens.max()) >= model.config.vocab_size:
            raise UserError(f"{p}: evaluation tokens exceed vocab_size; models must share a tokenizer")
        row = {"model": p, "method": info["method"] if info["quant_method"] != "none" else "fp",
               "bits": info["bits"], "ppl": perplexity(model, tokens, seqlen),
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
    from compress.prune import add_commands  # prune, lowrank, pipeline

    add_commands(sub)
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
