"""Quantization benchmark: quality and size on the shipped model, decode speed on a ~100M random Llama.

    OMP_NUM_THREADS=1 python bench/quantize.py [--model models/shakespeare-llama] [--quick] [--configs LABEL ...]
        [--no-quality | --no-speed] [--update] [--speed-rounds 3]

Quality: every method x width on the shipped Shakespeare model, perplexity on the held-out plays
(hamlet, tempest, julius_caesar), calibration on the training split. Speed: batch-1 greedy decode of a
random ~107M-param Llama (hidden 768, 16 layers, vocab 8192, tied), fp32 vs our 4-bit kernel vs
bitsandbytes NF4, with the fraction of the memory-bandwidth limit (weight bytes read per token x
tokens/s / measured copy bandwidth). Ratios are against baselines measured in the same run.
Writes bench/results/quantize.md (+ quantize.png).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.quantize_speed import speed, speed_report  # noqa: E402
from compress import calib  # noqa: E402
from compress.cli import main as compress_main  # noqa: E402
from compress.evaluate import format_table, kl_against, kl_reference, perplexity  # noqa: E402
from compress.loader import load  # noqa: E402
from compress.store import WeightSource  # noqa: E402
from memfit.hf import load_tokenizer  # noqa: E402
from memfit.modeldir import dir_bytes  # noqa: E402

QUALITY = [  # label, method, bits, extra args
    ("rtn-8", "rtn", 8, []), ("int8-bnb", "int8", 8, []),
    ("rtn-4", "rtn", 4, []), ("awq-4", "awq", 4, []), ("gptq-4", "gptq", 4, []), ("gptq-4-sym", "gptq", 4, ["--sym"]),
    ("nf4-bnb", "nf4", 4, []),
    ("rtn-3", "rtn", 3, []), ("awq-3", "awq", 3, []), ("gptq-3", "gptq", 3, []),
    ("rtn-2", "rtn", 2, []), ("gptq-2", "gptq", 2, []),
    # lm_head quantized too (`--skip ""`: untied into its own int4 Linear, RTN; the embedding stays fp16)
    ("rtn-4+lm_head", "rtn", 4, ["--skip", ""]), ("gptq-4+lm_head", "gptq", 4, ["--skip", ""]),
    # RTN with GPTQ's clipping search, GPTQ without it (its default since issue 24)
    ("rtn-4-mse", "rtn", 4, ["--mse-clip"]), ("gptq-4-noclip", "gptq", 4, ["--no-mse-clip"]),
    # spread of GPTQ's ppl change: without act-order (the default since issue 24), other calibration draws
    ("gptq-4-noact", "gptq", 4, ["--no-act-order"]), ("gptq-4-seed1", "gptq", 4, ["--seed", "1"]),
    ("gptq-4-seed2", "gptq", 4, ["--seed", "2"]),
]
QUICK = {"rtn-8", "rtn-4", "gptq-4", "nf4-bnb", "rtn-3", "gptq-3", "awq-3"}


def quantize(model: Path, out: Path, method: str, bits: int, extra: list[str], calib_args: list[str]) -> float:
    t0 = time.time()
    argv = ["quantize", str(model), "-o", str(out), "--method", method, "--bits", str(bits), "--overwrite", *extra]
    if method in ("gptq", "awq"):
        argv += calib_args
    if compress_main(argv) != 0:
        raise SystemExit(f"quantize failed: {argv}")
    return time.time() - t0


def linear_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the quantized Linear tensors, bytes those Linears' weights take in fp16)."""
    src = WeightSource(path)
    q, fp16 = 0, 0
    for k in src.keys():
        if ".weight_" in k:
            t = src.get(k)
            q += t.numel() * t.element_size()
            if k.endswith(".weight_shape"):
                fp16 += int(t.prod()) * 2
    return q, fp16


def quality(args: argparse.Namespace, work: Path) -> tuple[list[dict], dict]:
    model = Path(args.model)
    tok = load_tokenizer(str(model))
    eval_files = calib.default_eval_files()
    tokens = calib.eval_tokens(tok, eval_files, args.max_eval_tokens)
    calib_args = ["--calib", *map(str, calib.default_calib_files()), "--calib-samples", str(args.calib_samples),
                  "--calib-seqlen", str(args.calib_seqlen)]
    fp = load(model)
    base_ppl = perplexity(fp, tokens, args.seqlen)
    # KL(fp || quantized) on the first kl_tokens: the ppl change of a 4-bit model is a few hundredths, the
    # same size as the sign-random first-order effect of any small weight perturbation on held-out text
    # (swapping one Linear kind for its RTN copy moves ppl by up to -0.10); KL measures the damage itself.
    kl_ref = kl_reference(fp, tokens[: args.kl_tokens], args.seqlen)
    fp_bytes = dir_bytes(model)
    fp16_linear = sum(m.weight.numel() * 2 for n, m in fp.named_modules()
                      if isinstance(m, torch.nn.Linear) and not n.startswith("lm_head"))
    del fp
    rows = [{"config": "fp32 (original)", "bits": 32, "ppl": base_ppl, "d_ppl": 0.0, "kl_vs_fp": 0.0,
             "top1_agree": 1.0, "file_MiB": fp_bytes / 2**20, "file_x": 1.0, "linear_x_fp16": "-", "quant_s": 0.0}]
    for label, method, bits, extra in QUALITY:
        if (args.quick and label not in QUICK) or (args.configs and label not in args.configs):
            continue
        out = work / label
        try:
            secs = quantize(model, out, method, bits, extra, calib_args)
        except (SystemExit, Exception) as e:  # record it and go on with the other configs
            print(f"{label}: FAILED {e}", file=sys.stderr)
            rows.append({"config": f"{label} (FAILED: {e})", "bits": bits})
            continue
        m = load(out)
        ppl = perplexity(m, tokens, args.seqlen)
        kl, agree = kl_against(m, kl_ref)
        row = {"config": label, "bits": bits, "ppl": ppl, "d_ppl": ppl - base_ppl, "kl_vs_fp": kl, "top1_agree": agree,
               "file_MiB": dir_bytes(out) / 2**20, "file_x": dir_bytes(out) / fp_bytes, "quant_s": secs}
        if method in ("nf4", "int8") or "lm_head" in label:
            row["linear_x_fp16"] = "-"
        else:
            qb, fb = linear_bytes(out)
            row["linear_x_fp16"] = qb / fb
        if label == "gptq-4":  # the int4 kernel runs bf16 activations; the exact fp32 dequant path for comparison
            row["ppl_fp32_dequant"] = perplexity(load(out, backend="dequant"), tokens, args.seqlen)
        rows.append(row)
        print(f"{label}: ppl {ppl:.3f} ({ppl - base_ppl:+.3f}), {row['file_MiB']:.2f} MiB, {secs:.0f}s", flush=True)
        del m
    meta = {"eval_tokens": int(tokens.numel()), "eval_files": [f.name for f in eval_files],
            "kl_tokens": sum(w.numel() for w, _ in kl_ref),
            "fp16_linear_MiB": fp16_linear / 2**20}
    return rows, meta


def fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "**MISSED**"


def report(qrows: list[dict], qmeta: dict, srows: list[dict], smeta: dict, args: argparse.Namespace) -> str:
    by = {r["config"]: r for r in qrows}
    quick = " --quick" if args.quick else ""
    quick += "".join(f" {flag}" for flag, on in (("--no-quality", args.no_quality), ("--no-speed", args.no_speed),
                                                  ("--update", args.update)) if on)
    if args.configs:
        quick += " --configs " + " ".join(args.configs)
    kept = " (--update: the rows this run did not measure are kept from earlier runs, see quantize.json)"
    lines = ["# Quantization benchmark", "", f"Last updated by `OMP_NUM_THREADS=1 python bench/quantize.py{quick}`"
             f" on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{kept if args.update else ''}; CPU, "
             f"{torch.get_num_threads()} threads (machine shared with other jobs: timings are noisy).", ""]
    if qrows:
        lines += [f"## Quality and size: `{args.model}`", "",
                  f"Perplexity on {qmeta['eval_tokens']} tokens of the held-out plays ({', '.join(qmeta['eval_files'])}"
                  f"; first {args.max_eval_tokens // 3} tokens of each, windows of {args.seqlen}); calibration "
                  f"{args.calib_samples} x {args.calib_seqlen} tokens from the training split. Group size 128 "
                  "(mlp.down_proj: in_features 704 is not a multiple of 128, so it falls back to group 64). "
                  "lm_head (tied to the embedding) stays fp16, except in the `+lm_head` rows (`--skip \"\"`: "
                  "lm_head is untied into its own RTN int4 Linear, the embedding stays fp16 for the lookup). "
                  "`linear_x_fp16`: bytes of the quantized decoder-layer Linear "
                  f"tensors (packed ints + fp16 scales + zero points) / the same Linears in fp16 "
                  f"({qmeta['fp16_linear_MiB']:.2f} MiB). `file_x`: whole weight file / fp32 original. "
                  f"`kl_vs_fp`: mean per-token KL(fp32 || quantized) of the next-token distributions on the first "
                  f"{qmeta['kl_tokens']} eval tokens, `top1_agree`: how often both pick the same next token. "
                  "At 4 bits `d_ppl` is a few hundredths and of either sign by chance (any small perturbation of "
                  "the weights moves held-out perplexity up or down: in `quantize_layers.md`, replacing only the "
                  "up_proj Linears of the fp32 model by their RTN-4 copies *lowers* it by 0.10), so KL is the "
                  "lower-noise measure of the damage. The `gptq-4-noact` / `-seed1` / `-seed2` rows show the "
                  "spread of GPTQ's d_ppl over act-order and calibration draws.", "",
                  format_table([{k: fmt(v) if k not in ("kl_vs_fp", "top1_agree") or not isinstance(v, float)
                                 else f"{v:.5f}" for k, v in r.items()} for r in qrows],
                               ["config", "bits", "ppl", "d_ppl", "kl_vs_fp", "top1_agree", "file_MiB", "file_x",
                                "linear_x_fp16", "quant_s"]),
                  ""]
        if "gptq-4" in by and "ppl_fp32_dequant" in by["gptq-4"]:
            lines += [f"gptq-4 perplexity through the int4 kernel (bf16 activations): {by['gptq-4']['ppl']:.3f}; "
                      f"through the exact fp32 dequantize path: {by['gptq-4']['ppl_fp32_dequant']:.3f}.", ""]
    targets = []
    if "gptq-4" in by:
        targets.append(("4-bit g128 Linear bytes <= 0.30x fp16", f"{by['gptq-4']['linear_x_fp16']:.3f}x",
                        by["gptq-4"]["linear_x_fp16"] <= 0.30))
        if "rtn-4" in by:
            g, r = by["gptq-4"]["d_ppl"], by["rtn-4"]["d_ppl"]
            targets.append(("4-bit: GPTQ ppl increase <= 0.5x RTN's", f"{g:.3f} vs {r:.3f}", g <= 0.5 * r))
            g, r = by["gptq-4"]["kl_vs_fp"], by["rtn-4"]["kl_vs_fp"]
            targets.append(("(extra) 4-bit: GPTQ KL <= 0.5x RTN's", f"{g:.5f} vs {r:.5f}", g <= 0.5 * r))
        if "gptq-4-noclip" in by:
            g, r = by["gptq-4-noclip"]["d_ppl"], by["rtn-4"]["d_ppl"]
            targets.append(("(extra) 4-bit, both without clipping search: GPTQ ppl increase <= 0.5x RTN's",
                            f"{g:.3f} vs {r:.3f}", g <= 0.5 * r))
        if "nf4-bnb" in by:
            g, n = by["gptq-4"]["d_ppl"], by["nf4-bnb"]["d_ppl"]
            targets.append(("4-bit: GPTQ ppl increase <= NF4's", f"{g:.3f} vs {n:.3f}", g <= n))
    if "rtn-3" in by:
        best = min((by[k]["d_ppl"], k) for k in ("gptq-3", "awq-3") if k in by)
        r = by["rtn-3"]["d_ppl"]
        targets.append(("3-bit: GPTQ or AWQ ppl increase <= 0.5x RTN's", f"{best[1]} {best[0]:.3f} vs {r:.3f}",
                        best[0] <= 0.5 * r))
    slines, stargets = speed_report(srows, smeta, args, fmt)
    lines += slines
    targets += stargets
    if targets:  # none when --configs leaves out the rows they compare
        lines += ["## Targets", "", format_table([{"target": t, "measured": m, "result": verdict(ok)}
                                                   for t, m, ok in targets], ["target", "measured", "result"]), ""]
    return "\n".join(lines)


def plot(qrows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in ("rtn", "awq", "gptq"):
        pts = sorted((r["bits"], r["ppl"]) for r in qrows if r["config"] in (f"{method}-{b}" for b in (2, 3, 4, 8)))
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=method)
    base = qrows[0]["ppl"]
    ax.axhline(base, color="gray", linestyle="--", label="fp32")
    ax.set_xlabel("bits per weight")
    ax.set_ylabel("held-out perplexity")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("shakespeare-llama: perplexity vs width")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def merge(old: dict, qrows: list[dict], qmeta: dict, srows: list[dict], smeta: dict
          ) -> tuple[list[dict], dict, list[dict], dict]:
    """Stored results (quantize.json) updated with this run's rows, quality rows kept in QUALITY order."""
    qkeys = ("eval_tokens", "eval_files", "kl_tokens", "fp16_linear_MiB")
    skeys = ("cpu_isa", "bitsandbytes", "copy_bandwidth_GBps", "speed_threads", "speed_rounds")
    if qrows:
        new = {r["config"] for r in qrows}
        rows = {r["config"]: r for r in old.get("quality", []) if r["config"] not in new} | {r["config"]: r
                                                                                              for r in qrows}
        order = ["fp32 (original)"] + [q[0] for q in QUALITY]
        qrows = sorted(rows.values(), key=lambda r: order.index(r["config"]) if r["config"] in order else len(order))
    else:
        qrows, qmeta = old.get("quality", []), {k: old[k] for k in qkeys if k in old}
    if not srows:
        srows, smeta = old.get("speed", []), {k: old[k] for k in skeys if k in old}
    return qrows, qmeta, srows, smeta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/shakespeare-llama")
    p.add_argument("--work", default="out/bench-quantize", help="scratch dir for quantized models")
    p.add_argument("--quick", action="store_true", help="fewer configs, smaller calibration and eval")
    p.add_argument("--max-eval-tokens", type=int, default=30000)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--speed-rounds", type=int, default=3, help="round-robin decode passes, best of them is kept")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the speed section (default 1: on a "
                   "shared 2-core machine, 2 threads were 3-10x slower and erratic)")
    p.add_argument("--no-quality", action="store_true")
    p.add_argument("--configs", nargs="+", default=None, metavar="LABEL",
                   help=f"only these quality rows (of: {' '.join(q[0] for q in QUALITY)})")
    p.add_argument("--update", action="store_true", help="merge into the existing quantize.json: rows and sections "
                   "this run measures replace the stored ones, the rest are kept (same settings assumed)")
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--results", default=str(ROOT / "bench" / "results"))
    p.add_argument("--kl-tokens", type=int, default=8192)
    args = p.parse_args(argv)
    if args.quick:
        args.calib_samples, args.max_eval_tokens = min(args.calib_samples, 32), min(args.max_eval_tokens, 15000)
    if not args.no_quality and not (Path(args.model) / "config.json").is_file():
        print(f"{args.model} not found (train it: make demo / python -m training ...)", file=sys.stderr)
        return 2
    if not args.no_quality and not all(f.is_file() for f in calib.default_eval_files()):
        print("held-out plays missing: python -m training.shakespeare --dest .cache/shakespeare", file=sys.stderr)
        return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    qrows, qmeta = quality(args, work) if not args.no_quality else ([], {})
    srows, smeta = speed(args, work, quantize) if not args.no_speed else ([], {})
    results = Path(args.results)
    if args.update and (results / "quantize.json").is_file():
        qrows, qmeta, srows, smeta = merge(json.loads((results / "quantize.json").read_text()), qrows, qmeta, srows,
                                           smeta)
    text = report(qrows, qmeta, srows, smeta, args)
    results.mkdir(parents=True, exist_ok=True)
    (results / "quantize.md").write_text(text)
    (results / "quantize.json").write_text(json.dumps({"quality": qrows, "speed": srows, **qmeta, **smeta},
                                                      indent=1, default=str))
    if qrows:
        plot(qrows, results / "quantize.png")
    print(text)
    for label, *_ in QUALITY:  # quantized Shakespeare copies are cheap to rebuild; keep the speed models
        shutil.rmtree(work / label, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
