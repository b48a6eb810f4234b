"""bf16 weights on memfit's panel kernel (serve --dtype bf16, and auto on AVX512-BF16 CPUs) against fp32.

    python bench/bf16.py                     # Gemma 3 270M from `make real-model`
    python bench/bf16.py --model DIR --rounds 5

Three parts, all in one run on this host:

1. Kernels. The CPU's peak GFLOPS from a register-only loop (fp32 FMAs, vdpbf16ps) and the panel GEMM on the
   model's own Linear shapes (q/k/v fused, o, gate/up fused, down, lm_head): prefill (256 rows) as GFLOPS and
   a fraction of that peak, decode (1 row) as GB/s of weights read against the read bandwidth (a sum over
   1 GiB). fp32 and bf16 rounds interleaved, medians.
2. Quality on held-out Shakespeare (never calibration text): mean per-token KL(fp32 || bf16 weights), top-1
   agreement and perplexity, through the packed model's own forward (rows >= 8: x rounded to bf16 in every
   Linear, the prefill numerics; decode rows keep fp32 x and are closer still).
3. The serving engine's decode step (SlotModel.forward) at batch 1 and 16, fp32 vs bf16 weights, interleaved.

Writes bench/results/bf16.md and .json.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.embeddings import decode_ms, quality, real_model_args  # noqa: E402
from compress import calib  # noqa: E402
from compress.evaluate import host_isa  # noqa: E402
from memfit.hf import load_pretrained, load_tokenizer  # noqa: E402
from memfit.runtime import kernels  # noqa: E402
from memfit.runtime.slot_model import SlotModel  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """(N, K) of one layer's Linears (fused as the engine runs them) and of the lm_head."""
    h = cfg.hidden_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * d
    n16 = -(-cfg.vocab_size // 16) * 16
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * cfg.intermediate_size, h),
            "down": (h, cfg.intermediate_size), "lm_head": (n16, h)}


def read_gbs(mib: int = 1024, rounds: int = 5) -> float:
    """Memory read bandwidth: GB/s of a sum over a tensor far larger than the caches, the bound for streaming
    weights (a copy also writes, and measured less than half of this)."""
    a = torch.ones(mib * 2**18)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.numel() * 4 / best / 1e9


def gemm(ops, shp: dict[str, tuple[int, int]], rounds: int) -> dict:
    """Median ms per Linear shape, dtype and row count; the weights rotate through copies larger than the
    caches so decode reads them from memory, as a step does."""
    out: dict = {}
    for name, (n, k) in shp.items():
        copies = max(2, min(8, 2**28 // (n * k * 4)))
        w = torch.randn(n, k) * 0.02
        packed = {"fp32": [ops.pack_panels(w) for _ in range(copies)],
                  "bf16": [ops.pack_panels(w.bfloat16()) for _ in range(copies)]}
        for rows in (1, 256):
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {"fp32": [], "bf16": []}
            for _ in range(rounds):
                for dt, ps in packed.items():  # interleaved
                    t0 = time.perf_counter()
                    for p in ps:
                        ops.linear_panels(x, p)
                    times[dt].append((time.perf_counter() - t0) / len(ps) * 1e3)
            for dt, ts in times.items():
                ms = statistics.median(ts)
                out[f"{name}|{rows}|{dt}"] = {"ms": ms, "gflops": 2 * rows * n * k / ms / 1e6,
                                             "weight_gbs": n * k * (4 if dt == "fp32" else 2) / ms / 1e6}
    return out


def main(argv: list[str] | None = None) -> int:
    a = real_model_args(argv, __doc__, "bench/bf16.py", 5)
    if a is None:
        return 2
    ops = kernels.load("on")
    if not ops.has_avx512_bf16():
        print("bench/bf16.py: note: this CPU has no AVX512-BF16; bf16 runs as fp32 FMAs on widened weights")
    torch.manual_seed(0)
    fp = load_pretrained(a.model).eval()
    shp = shapes(fp.config)
    peak = {"fp32": statistics.median(ops.peak_gflops(False, 2_000_000) for _ in range(3))}
    if ops.has_avx512_bf16():
        peak["bf16"] = statistics.median(ops.peak_gflops(True, 2_000_000) for _ in range(3))
    bw = read_gbs()
    kern = gemm(ops, shp, a.rounds)
    print(f"peak GFLOPS {peak}, read {bw:.1f} GB/s")

    tok = load_tokenizer(a.model)
    tokens = calib.eval_tokens(tok, calib.default_eval_files(), a.tokens)
    bf = load_pretrained(a.model).eval()
    engines = {"fp32": SlotModel(fp, 16, 128, dense_kernel="auto", cpu_kernels="on"),
               "bf16": SlotModel(bf, 16, 128, dense_kernel="auto", cpu_kernels="on", bf16_weights=True)}
    qual = quality(fp, bf, tokens, a.seqlen)  # the HF forward over the packed modules
    qual["ppl_bf16"] = qual.pop("ppl")
    print(f"quality: {json.dumps(qual)}")
    speed: dict[str, dict[int, list[float]]] = {k: {1: [], 16: []} for k in engines}
    for _ in range(a.rounds):
        for name, sm in engines.items():
            for b in (1, 16):
                speed[name][b].append(decode_ms(sm, b))
    med = {k: {b: statistics.median(v) for b, v in d.items()} for k, d in speed.items()}
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": a.model,
              "host": f"{platform.processor() or platform.machine()} ({host_isa()}), {torch.get_num_threads()} threads",
              "torch": torch.__version__, "peak_gflops": peak, "read_gbs": bw, "gemm": kern, "quality": qual,
              "decode_ms_rounds": speed, "decode_ms_median": med}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bf16.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# bf16 weights on the panel kernel vs fp32 (`serve --dtype bf16`; `auto` on AVX512-BF16 CPUs)", "",
             f"Run {result['date']} on {result['host']}, torch {result['torch']}. Model: `{a.model}`. "
             f"Command: `python bench/bf16.py`. Medians of {a.rounds} interleaved rounds.", "",
             "Register-only peak: " + ", ".join(f"{k} {v:.0f} GFLOPS" for k, v in peak.items())
             + f"; memory read bandwidth {bw:.1f} GB/s (sum over 1 GiB).", "",
             "| Linear (N x K) | prefill 256 rows fp32 GFLOPS (% fp32 peak) | bf16 GFLOPS (% bf16 peak) | "
             "decode 1 row fp32 GB/s | bf16 GB/s | decode speed-up |", "|---|---:|---:|---:|---:|---:|"]
    pb = peak.get("bf16", peak["fp32"])
    for name, (n, k) in shp.items():
        f, b = kern[f"{name}|256|fp32"], kern[f"{name}|256|bf16"]
        f1, b1 = kern[f"{name}|1|fp32"], kern[f"{name}|1|bf16"]
        lines.append(f"| {name} ({n} x {k}) | {f['gflops']:.0f} ({100 * f['gflops'] / peak['fp32']:.0f}%) | "
                     f"{b['gflops']:.0f} ({100 * b['gflops'] / pb:.0f}%) | {f1['weight_gbs']:.1f} | "
                     f"{b1['weight_gbs']:.1f} | {f1['ms'] / b1['ms']:.2f}x |")
    lines += ["", f"Quality on {qual['tokens']} held-out tokens ({', '.join(calib.HELD_OUT)}), windows of "
              f"{a.seqlen}, prefill numerics (x rounded to bf16 in each Linear):", "", "| metric | value |",
              "|---|---:|", f"| mean per-token KL(fp32 \\|\\| bf16 weights) | {qual['kl_mean']:.6f} |",
              f"| top-1 agreement | {qual['top1_agreement']:.4f} |",
              f"| perplexity fp32 | {qual['ppl_fp32']:.3f} |", f"| perplexity bf16 weights | {qual['ppl_bf16']:.3f} |",
              "", "Decode step (SlotModel.forward, the serving engine):", "",
              "| batch | fp32 (ms) | bf16 weights (ms) | speed-up |", "|---:|---:|---:|---:|"]
    for b in (1, 16):
        lines.append(f"| {b} | {med['fp32'][b]:.2f} | {med['bf16'][b]:.2f} | {med['fp32'][b] / med['bf16'][b]:.2f}x |")
    (RESULTS / "bf16.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
