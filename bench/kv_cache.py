"""The paged KV cache against the static slot cache, prefix caching, and int8 KV (issue 21's benchmarks).

    python bench/kv_cache.py                  # all parts (~15-20 min on 2 cores)
    python bench/kv_cache.py --parts int8     # one part: capacity, capacity_gemma, prefix, int8, regression

Parts, each with its baseline measured in the same run:

1. capacity: a mixed workload (64 requests submitted at once, prompt lengths 32-1500 and output lengths 16-512,
   seeded) under one KV budget (256 MiB) on the bench model (the serving benchmark's random 30M Llama, fp32):
   peak concurrently running sequences and generated tok/s, paged (blocks of 16) vs static slots of
   max_seq_len 2048 at the same bytes. capacity_gemma: the same on the real Gemma 3 270M (bf16 weights, serve's
   default where the CPU has avx512_bf16; fp32 KV), whose 15 sliding layers (window 512) give back the blocks
   behind their window (memfit.runtime.kv_groups).
2. prefix: 64 requests sharing a 1024-token system prompt, each with its own 32-token question, 8 in flight
   (closed loop): TTFT p50 / p95 with prefix caching and without; outputs compared.
3. int8: KV bytes per token (scales included) and the sequences a budget holds, int8 vs fp32; mean per-token
   KL(fp32-KV || int8-KV) and top-1 agreement on held-out Shakespeare through the real Gemma 3 270M (fp32
   weights, so only the cache differs); the engine's decode step at batch 16 over 512-token contexts, int8 vs
   fp32 KV (bf16 weights, serve's default on this CPU), interleaved rounds, medians.
4. regression: the engine at concurrency 1 and 16 (64-token prompts, 64 new tokens), paged vs static, on the
   bench model, interleaved rounds, medians.

The engine runs offline (serve.engine.Engine on its own thread, no HTTP) so that only the cache differs.
Writes bench/results/kv_cache.md, .json and .png.
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.embeddings import decode_ms  # noqa: E402
from bench.serving import build_model  # noqa: E402
from compress import calib  # noqa: E402
from compress.evaluate import host_isa  # noqa: E402
from memfit.hf import load_pretrained, load_tokenizer  # noqa: E402
from memfit.runtime.slot_model import Segment, SlotModel  # noqa: E402
from serve.engine import Engine, Sequence  # noqa: E402
from serve.kv_config import kv_bytes_per_token, kv_layout, model_kv_elem_bytes  # noqa: E402
from serve.sampling import SamplingParams  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MIB = 2 ** 20
GEMMA = ROOT / ".cache" / "models" / "gemma3-270m"


def slot_model(model_dir: Path, max_batch: int, max_seq_len: int, budget: int | None = None, block_size: int = 16,
               int8: bool = False, bf16: bool = False) -> SlotModel:
    """The engine's model: static slots (budget None) or a paged cache of ``budget`` bytes in blocks."""
    hf = load_pretrained(str(model_dir)).eval()
    kw = dict(dense_kernel="auto", cpu_kernels="on", bf16_weights=bf16,
              cache_dtype=torch.int8 if int8 else None)
    if budget is None:
        return SlotModel(hf, max_batch, max_seq_len, **kw)
    lay = kv_layout(hf.config, model_kv_elem_bytes(hf, bf16), "int8" if int8 else "auto", block_size, max_seq_len)
    return SlotModel(hf, max_batch, max_seq_len, **kw, num_blocks=budget // lay.bytes_per_block,
                     block_size=block_size)


def run_engine(sm: SlotModel, tok, work: list[tuple[list[int], int]], in_flight: int, prefix_caching: bool = True,
               prefill_chunk: int = 256) -> dict:
    """Run ``work`` ((prompt ids, output length) each, greedy, EOS ignored) with at most ``in_flight`` requests
    submitted at a time (a closed loop); tok/s, TTFTs, the peak of running sequences, the outputs."""
    eng = Engine(sm, tok, set(), prefill_chunk=prefill_chunk, max_queue=len(work) + 1,
                 prefix_caching=prefix_caching)
    done: queue.Queue = queue.Queue()
    peak = [0]
    ttft: dict[int, float] = {}
    outs: dict[int, list[int]] = {}

    def hook(segs):
        peak[0] = max(peak[0], eng.num_running())

    eng.step_hook = hook
    sent: dict[int, float] = {}

    def submit(i: int) -> None:
        ids, n = work[i]

        def sink(ev, i=i):
            if ev.token is not None or ev.text:
                ttft.setdefault(i, time.perf_counter() - sent[i])
            if ev.finish_reason is not None:
                done.put((i, ev.finish_reason, ev.error))

        s = Sequence(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), sink, sm.vocab_size)
        outs[i] = s.out_ids
        sent[i] = time.perf_counter()
        eng.submit([s])

    t0 = time.perf_counter()
    nxt = 0
    while nxt < min(in_flight, len(work)):
        submit(nxt)
        nxt += 1
    finished = 0
    while finished < len(work):
        i, reason, err = done.get(timeout=3600)
        if reason != "length":
            raise RuntimeError(f"request {i} finished with {reason}: {err}")
        finished += 1
        if nxt < len(work):
            submit(nxt)
            nxt += 1
    wall = time.perf_counter() - t0
    pool = eng.scheduler.pool
    stats = {"prefix_queries": pool.queries, "prefix_hits": pool.hits, "blocks": pool.num_blocks} if pool else {}
    eng.stop()
    gen = sum(len(o) for o in outs.values())
    tt = sorted(ttft.values())
    return {"tok_s": gen / wall, "wall_s": wall, "generated": gen, "peak_running": peak[0],
            "ttft_p50_ms": 1e3 * statistics.median(tt), "ttft_p95_ms": 1e3 * tt[int(0.95 * (len(tt) - 1))],
            "preemptions": eng.scheduler.num_preemptions, "pool": stats, "outputs": outs}


def mixed_work(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(32, 1500))], rng.randint(16, 512))
            for _ in range(n)]


def part_capacity(model_dir: Path, tok, budget: int, bf16: bool = False) -> dict:
    work = mixed_work(64, len(tok))
    msl = 2048
    paged = slot_model(model_dir, 64, msl, budget, bf16=bf16)
    # a static slot: msl positions in every layer
    slot_bytes = kv_bytes_per_token(paged.hf.config, model_kv_elem_bytes(paged.hf, bf16)) * msl
    static_slots = max(1, budget // slot_bytes)
    static = slot_model(model_dir, static_slots, msl, bf16=bf16)
    groups = paged.kv_groups
    out = {"budget_mib": budget / MIB, "static_slots": static_slots, "paged_blocks": paged.num_blocks,
           "kv_groups": f"{len(groups)} x {groups.size} layers, windows {sorted({w or 0 for w in groups.windows})}",
           "prompt_tokens": sum(len(p) for p, _ in work), "output_tokens": sum(n for _, n in work)}
    for name, sm in (("static", static), ("paged", paged)):
        print(f"capacity: {name} ...", flush=True)
        r = run_engine(sm, tok, work, in_flight=64)
        r.pop("outputs")
        out[name] = r
        print(f"  {name}: {r['tok_s']:.1f} tok/s, peak running {r['peak_running']}, preemptions "
              f"{r['preemptions']}", flush=True)
    out["running_ratio"] = out["paged"]["peak_running"] / out["static"]["peak_running"]
    out["tok_s_ratio"] = out["paged"]["tok_s"] / out["static"]["tok_s"]
    return out


def part_prefix(model_dir: Path, tok) -> dict:
    rng, vocab = random.Random(1), len(tok)
    system = [rng.randrange(10, vocab) for _ in range(1024)]
    work = [(system + [rng.randrange(10, vocab) for _ in range(32)], 16) for _ in range(64)]
    sm = slot_model(model_dir, 16, 2048, budget=1024 * MIB)
    out = {}
    for name, on in (("no_cache", False), ("cache", True)):
        print(f"prefix: {name} ...", flush=True)
        r = run_engine(sm, tok, work, in_flight=8, prefix_caching=on)
        out[name] = r
        print(f"  {name}: TTFT p50 {r['ttft_p50_ms']:.0f} ms p95 {r['ttft_p95_ms']:.0f} ms, {r['tok_s']:.1f} tok/s",
              flush=True)
    out["same_outputs"] = out["cache"].pop("outputs") == out["no_cache"].pop("outputs")
    out["ttft_p50_ratio"] = out["cache"]["ttft_p50_ms"] / out["no_cache"]["ttft_p50_ms"]
    return out


@torch.inference_mode()
def all_logits(sm: SlotModel, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits in one step: each token a 1-token segment of slot 0 (the step writes all K/V, then
    each token attends to the positions up to its own, through the cache as a decode does)."""
    return sm.forward(ids, [Segment(0, p, 1) for p in range(len(ids))])


def part_int8(model_dir: Path, rounds: int, tokens: int, seqlen: int) -> dict:
    import torch.nn.functional as F

    out: dict = {}
    for name, d in (("bench_model", model_dir), ("gemma3_270m", GEMMA)):
        f, q = slot_model(d, 1, 64, budget=64 * MIB), slot_model(d, 1, 64, budget=64 * MIB, int8=True)
        out[f"bytes_per_token_{name}"] = {"fp32": f.bytes_per_block / f.block_size,
                                          "int8": q.bytes_per_block / q.block_size}
        del f, q
    ids = calib.eval_tokens(load_tokenizer(str(GEMMA)), calib.default_eval_files(), tokens)
    f = slot_model(GEMMA, 1, seqlen, budget=None)
    q = slot_model(GEMMA, 1, seqlen, budget=None, int8=True)
    kl = agree = n = 0.0
    for s in range(0, len(ids) - seqlen + 1, seqlen):
        lp = F.log_softmax(all_logits(f, ids[s:s + seqlen]), -1)
        lq = F.log_softmax(all_logits(q, ids[s:s + seqlen]), -1)
        kl += float((lp.exp() * (lp - lq)).sum())
        agree += float((lp.argmax(-1) == lq.argmax(-1)).sum())
        n += seqlen
    out["gemma3_kl_mean"], out["gemma3_top1_agreement"], out["eval_tokens"] = kl / n, agree / n, int(n)
    del f, q
    print(f"int8: KL {out['gemma3_kl_mean']:.2e}, top-1 {out['gemma3_top1_agreement']:.4f}", flush=True)
    speeds: dict[str, list[float]] = {"fp32": [], "int8": []}
    models = {k: slot_model(GEMMA, 16, 1024, budget=None, int8=k == "int8", bf16=True) for k in speeds}
    for _ in range(rounds):
        for k, sm in models.items():
            speeds[k].append(16 / decode_ms(sm, 16, steps=8, prompt=512) * 1e3)
    out["decode_c16_tok_s"] = {k: statistics.median(v) for k, v in speeds.items()}
    out["decode_c16_rounds"] = speeds
    out["decode_ratio"] = out["decode_c16_tok_s"]["int8"] / out["decode_c16_tok_s"]["fp32"]
    b = out["bytes_per_token_gemma3_270m"]
    out["gemma3_bytes_ratio"] = b["int8"] / b["fp32"]
    print(f"int8: decode c16 {out['decode_c16_tok_s']}, bytes ratio {out['gemma3_bytes_ratio']:.3f}", flush=True)
    return out


def part_regression(model_dir: Path, tok, rounds: int) -> dict:
    rng, vocab = random.Random(2), len(tok)
    work = {c: [([rng.randrange(10, vocab) for _ in range(64)], 64) for _ in range(max(4, 2 * c))] for c in (1, 16)}
    static = slot_model(model_dir, 16, 2048)
    models = {"static": static, "paged": slot_model(model_dir, 16, 2048, budget=static.cache_bytes)}
    res: dict = {f"c{c}": {k: [] for k in models} for c in work}
    for _ in range(rounds):
        for c, w in work.items():
            for k, sm in models.items():
                res[f"c{c}"][k].append(run_engine(sm, tok, w, in_flight=c)["tok_s"])
    out = {}
    for c, r in res.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        out[c] = {"tok_s": med, "rounds": r, "ratio": med["paged"] / med["static"]}
        print(f"regression {c}: {med}, paged/static {out[c]['ratio']:.3f}", flush=True)
    return out


def _ran(part: dict) -> str:
    """A section title's date: parts not rerun keep their numbers from an earlier run (and host)."""
    return f" (run {part['date']})" if "date" in part else " (run 2026-12-06)"


def write_report(data: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv_cache.json").write_text(json.dumps(data, indent=1))
    lines = ["# KV cache: paged vs static slots, prefix caching, int8 KV", "",
             f"Host of the latest run: {data['host']}; torch {data['torch']}; {data['date']}. Bench model: "
             f"{data['bench_model']}. Each section says when it ran.",
             "Produced by `python bench/kv_cache.py`; every ratio is against a baseline run in the same process.", ""]
    for key, title in (("capacity", "the bench model (fp32)"), ("capacity_gemma", "Gemma 3 270M (bf16 weights)")):
        c = data.get(key)
        if not c:
            continue
        lines += [f"## 1. Capacity under one KV budget: {title}{_ran(c)}", "",
                  f"{c['budget_mib']:.0f} MiB of fp32 KV; 64 requests at once, prompts 32-1500 tokens "
                  f"({c['prompt_tokens']} in all), outputs 16-512 ({c['output_tokens']}), greedy. Static: "
                  f"{c['static_slots']} slots of 2048 positions; paged: {c['paged_blocks']} blocks of 16 "
                  f"(KV groups: {c.get('kv_groups', '1 x every layer')}).", "",
                  "| cache | peak running | tok/s | wall s | preemptions |", "|---|---:|---:|---:|---:|"]
        for k in ("static", "paged"):
            r = c[k]
            lines.append(f"| {k} | {r['peak_running']} | {r['tok_s']:.1f} | {r['wall_s']:.1f} | {r['preemptions']} |")
        lines += ["", f"Paged / static: running sequences {c['running_ratio']:.2f}x (target >= 4x), tok/s "
                  f"{c['tok_s_ratio']:.2f}x (target >= 2x).", ""]
    p = data.get("prefix")
    if p:
        lines += [f"## 2. Prefix caching{_ran(p)}", "",
                  "64 requests: one 1024-token system prompt + a 32-token question each, 16 new tokens, 8 in flight.",
                  "", "| | TTFT p50 ms | TTFT p95 ms | tok/s | prefix hits / queries (tokens) |",
                  "|---|---:|---:|---:|---:|"]
        for k in ("no_cache", "cache"):
            r = p[k]
            lines.append(f"| {k} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} | {r['tok_s']:.1f} | "
                         f"{r['pool'].get('prefix_hits', 0)} / {r['pool'].get('prefix_queries', 0)} |")
        lines += ["", f"TTFT p50 with / without: {p['ttft_p50_ratio']:.3f}x (target <= 0.2x); identical outputs: "
                  f"{p['same_outputs']}.", ""]
    q = data.get("int8")
    if q:
        bm, gm = q["bytes_per_token_bench_model"], q["bytes_per_token_gemma3_270m"]
        d = q["decode_c16_tok_s"]
        lines += [f"## 3. int8 KV{_ran(q)}", "",
                  "| model | fp32 KV bytes/token | int8 KV bytes/token (with scales) | ratio | sequences that fit |",
                  "|---|---:|---:|---:|---:|",
                  f"| bench model | {bm['fp32']:.0f} | {bm['int8']:.0f} | {bm['int8'] / bm['fp32']:.3f} | "
                  f"{bm['fp32'] / bm['int8']:.2f}x |",
                  f"| Gemma 3 270M | {gm['fp32']:.0f} | {gm['int8']:.0f} | {gm['int8'] / gm['fp32']:.3f} | "
                  f"{gm['fp32'] / gm['int8']:.2f}x |", "",
                  f"Quality, Gemma 3 270M (fp32 weights; only the cache differs), {q['eval_tokens']} held-out tokens "
                  f"(calib.default_eval_files, never calibration text): mean per-token KL(fp32 KV || int8 KV) "
                  f"{q['gemma3_kl_mean']:.2e} (target <= 0.01), top-1 agreement {q['gemma3_top1_agreement']:.4f}.", "",
                  f"Decode step at batch 16 over 512-token contexts (bf16 weights): fp32 KV {d['fp32']:.1f} tok/s, "
                  f"int8 KV {d['int8']:.1f} tok/s: {q['decode_ratio']:.3f}x (target >= 0.95x).", ""]
    g = data.get("regression")
    if g:
        lines += [f"## 4. No regression: paged vs static at the same bytes{_ran(g)}", "",
                  "| concurrency | static tok/s | paged tok/s | paged / static |", "|---:|---:|---:|---:|"]
        for k, r in ((k, r) for k, r in g.items() if k != "date"):
            lines.append(f"| {k[1:]} | {r['tok_s']['static']:.1f} | {r['tok_s']['paged']:.1f} | {r['ratio']:.3f} |")
        n = len(g["c1"]["rounds"]["static"])
        lines += ["", f"Medians of {n} interleaved rounds. Target: >= 0.97x.", ""]
    (RESULTS / "kv_cache.md").write_text("\n".join(lines))
    plot(data)


def plot(data: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    bars = []
    for key, name in (("capacity", "capacity"), ("capacity_gemma", "Gemma 3")):
        if key in data:
            c = data[key]
            bars += [(f"{name}:\nrunning seqs", c["running_ratio"], 4.0), (f"{name}:\ntok/s", c["tok_s_ratio"], 2.0)]
    if "prefix" in data:
        bars.append(("prefix:\nTTFT p50 (lower)", data["prefix"]["ttft_p50_ratio"], 0.2))
    if "int8" in data:
        q = data["int8"]
        bars += [("int8: bytes\n(lower)", q["gemma3_bytes_ratio"], 0.3), ("int8: decode\nc16", q["decode_ratio"], 0.95)]
    if "regression" in data:
        bars += [(f"paged/static\n{k}", r["ratio"], 0.97) for k, r in data["regression"].items() if k != "date"]
    if not bars:
        return
    fig, ax = plt.subplots(figsize=(1.4 * len(bars) + 2, 4))
    xs = range(len(bars))
    ax.bar(xs, [b[1] for b in bars], color="tab:blue", label="measured ratio")
    ax.scatter(xs, [b[2] for b in bars], color="tab:red", marker="_", s=800, label="target", zorder=3)
    ax.set_xticks(list(xs), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("ratio to the baseline in the same run")
    ax.set_title(f"KV cache ({data['host']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "kv_cache.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/kv_cache.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="capacity,capacity_gemma,prefix,int8,regression")
    ap.add_argument("--budget-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens for int8's KL")
    ap.add_argument("--seqlen", type=int, default=512)
    a = ap.parse_args(argv)
    parts = a.parts.split(",")
    unknown = set(parts) - {"capacity", "capacity_gemma", "prefix", "int8", "regression"}
    if unknown:
        print(f"bench/kv_cache.py: error: --parts: unknown {sorted(unknown)}", file=sys.stderr)
        return 2
    if {"int8", "capacity_gemma"} & set(parts) and not (GEMMA / "config.json").is_file():
        print(f"bench/kv_cache.py: error: no model at {GEMMA} (run `make real-model`)", file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="kv_cache_bench_"))
    model_dir = work / "llama30m"
    params = build_model(model_dir, 512, 10, 1408, 8, 4, 4096)
    tok = load_tokenizer(str(model_dir))
    data = {"host": f"{platform.processor() or platform.machine()} ({host_isa()}), {torch.get_num_threads()} threads",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "bench_model": f"random Llama, hidden 512, 10 layers, 8 / 4 KV heads, head_dim 64, {params / 1e6:.1f}M "
                           "params, fp32"}
    old = RESULTS / "kv_cache.json"
    if old.is_file():  # parts not rerun keep their last numbers
        data = {**{k: v for k, v in json.loads(old.read_text()).items() if k not in parts}, **data}
    if "capacity" in parts:
        data["capacity"] = part_capacity(model_dir, tok, a.budget_mib * MIB)
    if "capacity_gemma" in parts:
        data["capacity_gemma"] = part_capacity(GEMMA, load_tokenizer(str(GEMMA)), a.budget_mib * MIB, bf16=True)
    if "prefix" in parts:
        data["prefix"] = part_prefix(model_dir, tok)
    if "int8" in parts:
        data["int8"] = part_int8(model_dir, a.rounds, a.tokens, a.seqlen)
    if "regression" in parts:
        data["regression"] = part_regression(model_dir, tok, a.rounds)
    for p in parts:
        data[p]["date"] = data["date"]
    write_report(data)
    print((RESULTS / "kv_cache.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
