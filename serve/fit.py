"""``memfit fit MODEL --memory 8GiB --for serve``: the fastest ``serve`` command line that fits a memory budget.

1. Predict (serve.fit_predict): every weight format x KV dtype gets the most running sequences (up to the
   workload's concurrency) and the preferred prefill chunk (fit_predict.CHUNKS) whose predicted peak fits; so
   does fp32 placed over RAM and disk (serve --max-memory cpu=X: the layers that do not fit in X are read from
   the checkpoint every step), ranked after every in-RAM candidate.
2. Verify, fastest-looking first (more sequences at once, then fewer weight bytes, then fewer KV bytes): each
   candidate runs in its own process (serve.fit_probe) with serve's own load and engine at the workload's shape
   and reports its peak RSS (loading included), prefill and decode timings and, against the unquantized
   model on held-out text (serve.fit_quality), KL and top-1 agreement. Over budget or below the quality bound:
   rejected, the next one is tried.
3. Choose the verified candidate with the highest workload throughput: waves x (prefill of a wave + (output - 1)
   decode steps at its width), from the measured phases. Those within CONFIRM_WITHIN of the fastest run again
   first, interleaved (--confirm-rounds), and are compared by their median.

Writes to --out: candidates.json / candidates.md (predicted vs measured), frontier.png, command.txt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from memfit.errors import UserError
from memfit.modeldir import atomic_file, check_model_dir
from memfit.sizes import format_bytes, parse_size
from serve import fit_predict as fp
from serve.fit_report import write_outputs

BLOCK = 16
DEFAULT_QUALITY = "kl<=0.05"
CONFIRM_WITHIN = 0.10
"""Verified candidates within this fraction of the fastest one's throughput run again (--confirm-rounds) before
one is chosen: on a 2-core host one run's timings vary by ~10%."""


DISK = "fp32+disk"
"""--formats name of fp32 placed over RAM and disk (fit_predict.disk_offload)."""


@dataclass
class Workload:
    concurrency: int = 16
    prompt: int = 512
    output: int = 256

    def running_options(self) -> list[int]:
        """Running sequences to try, most first: the concurrency, halved down to 1."""
        return sorted({self.concurrency >> i for i in range(8) if self.concurrency >> i}, reverse=True)


@dataclass
class Quality:
    kl: float | None = None
    top1: float | None = None

    def misses(self, m: dict) -> str | None:
        if self.kl is not None and m.get("kl", math.inf) > self.kl:
            return f"kl {m.get('kl', math.nan):.4f} > {self.kl}"
        if self.top1 is not None and m.get("top1", 0.0) < self.top1:
            return f"top1 {m.get('top1', math.nan):.3f} < {self.top1}"
        return None


def parse_workload(text: str) -> Workload:
    w = Workload()
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in w.__dataclass_fields__:
            raise UserError(f"--workload: unknown key {key!r} (known: concurrency, prompt, output)")
        if not value.isdigit() or int(value) < 1:
            raise UserError(f"--workload: {key} must be a positive integer, got {value!r}")
        setattr(w, key, int(value))
    return w


def parse_quality(text: str) -> Quality:
    q = Quality()
    for part in filter(None, (p.strip() for p in text.split(","))):
        for key, op in (("kl", "<="), ("top1", ">=")):
            if part.startswith(key + op):
                try:
                    setattr(q, key, float(part[len(key) + 2:]))
                except ValueError:
                    raise UserError(f"--min-quality: {part!r}: not a number after {op}") from None
                break
        else:
            raise UserError(f"--min-quality: unknown bound {part!r} (kl<=X and/or top1>=Y, e.g. kl<=0.02)")
    return q


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memfit fit --for serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF checkpoint dir (safetensors)")
    p.add_argument("--memory", required=True, help="the budget for the whole serve process (RSS), e.g. 2GiB")
    p.add_argument("--workload", default="concurrency=16,prompt=512,output=256",
                   help="concurrency (requests at once), prompt and output tokens per request")
    p.add_argument("--min-quality", default=DEFAULT_QUALITY, help="bounds against the unquantized model on held-"
                   f"out text: kl<=X (mean per-token KL), top1>=Y (default {DEFAULT_QUALITY}; 'none' to skip)")
    p.add_argument("--quality-text", nargs="+", default=None, metavar="FILES",
                   help="held-out text for the quality bound (default: the held-out Shakespeare plays)")
    p.add_argument("--quantized", nargs="*", default=[], metavar="DIR",
                   help="compress outputs of this model to consider too (e.g. compress quantize --bits 4)")
    p.add_argument("--formats", default=None, help="weight formats to consider, comma-separated (default: all of "
                   "fp32, bf16, int8, int8+vocab8, each --quantized DIR's name, alone and +vocab8, and fp32+disk: "
                   "fp32 placed over RAM and disk, the layers that do not fit read from the checkpoint every step)")
    p.add_argument("--out", default="runs/fit-serve", help="where the tables, the PNG and the command go")
    p.add_argument("--max-verify", type=int, default=6, help="candidates verified by a real run at most, once one "
                   "passes (more are tried while none has)")
    p.add_argument("--confirm-rounds", type=int, default=1, help="more runs, interleaved, of the verified "
                   f"candidates within {CONFIRM_WITHIN:.0%} of the fastest; each one's throughput is then the median "
                   "(0: choose from one run)")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps timed in each verification run")
    p.add_argument("--threads", type=int, default=None, help="serve --threads for every run")
    p.add_argument("--fresh", action="store_true", help="ignore measurements cached before")
    p.add_argument("--measurements", default=None, metavar="FILE", help="where verification runs are cached, by "
                   "command line (default: --out/measurements.json); fits of other budgets can share one")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def probe(args: list[str], probe_args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "serve.fit_probe", *probe_args, "--", *args, "--log-level", "warning"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"TQDM_DISABLE": "1"})
    line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("FITPROBE ")), None)
    if line is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {r.returncode}: " + " | ".join(tail)}
    return json.loads(line[len("FITPROBE "):])


def enumerate_candidates(model: str, quantized: list[str], w: Workload, budget: int, base: dict,
                         kernels: bool, only: list[str] | None = None) -> tuple[list[fp.Candidate], list[fp.Candidate]]:
    """(candidates predicted to fit, the smallest one per format/KV dtype that does not)."""
    config = fp.read_model_config(model)
    s = fp.shapes(model)
    formats = fp.dense_formats(model, s, kernels)
    for q in quantized:
        formats += fp.compressed_formats(q, Path(q).name, s, kernels)
    if only is not None:
        unknown = sorted(set(only) - {f.name for f in formats} - {DISK})
        if unknown:
            raise UserError(f"--formats: unknown {', '.join(unknown)} (here: "
                            f"{', '.join(f.name for f in formats)}, {DISK})")
        formats = [f for f in formats if f.name in only]
    seq_len = w.prompt + w.output
    fits, misses = [], []
    for fmt in formats:
        for kv_dtype in ("auto", "int8"):
            smallest = None
            for running in w.running_options():
                for chunk in fp.CHUNKS:
                    kv = fp.kv_plan(config, fmt, kv_dtype, running, seq_len, BLOCK, min(chunk, w.prompt))
                    c = fp.Candidate(fmt, kv_dtype, running, min(chunk, w.prompt), kv, seq_len)
                    c.predicted = fp.predict(base["rss_base"], base["rss_tokenizer"], s, config, fmt, kv, running,
                                             c.prefill_chunk, seq_len)
                    smallest = c
                    if c.predicted["peak"] <= budget:
                        break
                if smallest.predicted["peak"] <= budget:
                    break
            (fits if smallest.predicted["peak"] <= budget else misses).append(smallest)
            if not kernels:
                break  # int8 KV runs on memfit's kernels
    if only is None or DISK in only:
        fits += offloaded(model, s, config, w, budget, base)
    return fits, misses


def offloaded(model: str, s: fp.Shapes, config: dict, w: Workload, budget: int, base: dict) -> list[fp.Candidate]:
    """The most running sequences whose fp32 weights, placed over RAM and disk, fit (fit_predict.disk_offload):
    ranked after every in-RAM candidate (each step reads the offloaded layers again), measured like them."""
    seq_len, chunk = w.prompt + w.output, min(fp.CHUNKS[0], w.prompt)
    for running in w.running_options():
        placed = fp.disk_offload(model, s, config, running, chunk, seq_len, base["rss_base"], budget)
        if placed is not None:
            fmt, kv = placed
            c = fp.Candidate(fmt, "auto", running, chunk, kv, seq_len)
            c.predicted = fp.predict(base["rss_base"], base["rss_tokenizer"], s, config, fmt, kv, running, chunk,
                                     seq_len)
            return [c]
    return []


def rank_key(c: fp.Candidate) -> tuple:
    """In RAM before placed over disk; then more sequences at once, fewer weight bytes streamed per decode step,
    fewer KV bytes (the two KV dtypes of a format side by side: which is faster depends on the context length
    and the kernels)."""
    return c.fmt.placed, -c.running, c.predicted["weights"], c.kv_bytes


def throughput(m: dict, running: int, w: Workload) -> float:
    """Output tokens/s of the whole workload from a verification run's phases (``m``): the concurrency in waves
    of ``running`` sequences, each a prefill phase then ``output - 1`` decode steps."""
    waves = math.ceil(w.concurrency / running)
    seconds = waves * (m["prefill_s"] + (w.output - 1) * m["decode_step_s"])
    return w.concurrency * w.output / seconds


def fit(args: argparse.Namespace) -> dict:
    model = str(check_model_dir(args.model, "MODEL"))
    budget = parse_size(args.memory, "--memory")
    w = parse_workload(args.workload)
    quality = Quality() if args.min_quality.strip().lower() == "none" else parse_quality(args.min_quality)
    if args.max_verify < 1:
        raise UserError(f"--max-verify must be >= 1, got {args.max_verify}")
    if args.confirm_rounds < 0:
        raise UserError(f"--confirm-rounds must be >= 0, got {args.confirm_rounds}")
    quantized = [str(check_model_dir(q, "--quantized")) for q in args.quantized]
    from serve.fit_quality import make_reference, quality_files

    files = quality_files(args.quality_text) if (quality.kl, quality.top1) != (None, None) else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from memfit.runtime import kernels

    has_kernels = kernels.load("auto") is not None
    extra = ["--threads", str(args.threads)] if args.threads else []
    base = probe(["--model", model, *extra], ["--base-only"])
    if "rss_base" not in base:
        raise UserError(f"MODEL: serve cannot start on {model}: {base.get('error')}")
    from serve.kv_config import available_memory

    avail = available_memory("cpu") + base["rss_base"]  # what a serve process could grow to here
    if avail < budget:
        print(f"fit: --memory {format_bytes(budget)} is more than this machine has available "
              f"({format_bytes(avail)}): planning for {format_bytes(avail)}", file=sys.stderr)
    only = [f.strip() for f in args.formats.split(",") if f.strip()] if args.formats else None
    fits, misses = enumerate_candidates(model, quantized, w, min(budget, avail), base, has_kernels, only)
    if not fits:
        smallest = min(misses, key=lambda c: c.predicted["peak"])
        raise UserError(f"--memory {format_bytes(budget)} fits no candidate: the smallest, {smallest.name}, is "
                        f"predicted to peak at {format_bytes(smallest.predicted['peak'])} (the smallest feasible "
                        f"budget), of which {format_bytes(base['rss_base'])} is the Python process before any "
                        "weights")
    ref = None
    if files is not None:
        ref = str(make_reference(model, files, 4, 64, out / "reference.safetensors"))
    cache_path = Path(args.measurements) if args.measurements else out / "measurements.json"
    cache = {} if args.fresh or not cache_path.is_file() else json.loads(cache_path.read_text())
    passed: list[fp.Candidate] = []
    verified = 0
    low_quality: set[str] = set()  # formats whose weights alone (KV at full width) missed the quality bound

    def run(c: fp.Candidate, tag: str = "", with_ref: bool = True) -> dict:
        shape = ["--running", str(c.running), "--prompt", str(w.prompt), "--decode-steps",
                 str(min(args.decode_steps, w.output - 1) or 1)]
        key = " ".join(c.serve_args() + extra + shape) + tag  # the command line and the workload's shape it ran
        if key not in cache or (with_ref and ref and "kl" not in cache[key]):
            print(f"fit: verifying {c.name}{tag} (predicted peak {format_bytes(c.predicted['peak'])})",
                  file=sys.stderr, flush=True)
            cache[key] = probe(c.serve_args() + extra, shape + (["--ref", ref] if ref and with_ref else []))
            atomic_file(cache_path, lambda tmp: tmp.write_text(json.dumps(cache, indent=1)))
        return dict(cache[key])

    for c in sorted(fits, key=rank_key):
        if verified >= args.max_verify and passed:
            break
        if c.fmt.name in low_quality:
            c.status = "skipped: its weights missed the quality bound"
            continue
        c.measured = run(c)
        verified += 1
        if "error" in c.measured:
            c.status = "failed: " + c.measured["error"][:120]
        elif c.measured["peak"] > budget:
            c.status = f"over budget ({format_bytes(c.measured['peak'])})"
        elif (why := quality.misses(c.measured)) is not None:
            c.status = "below quality: " + why
            if c.kv_dtype == "auto":  # an int8 KV cache on the same weights only adds to the KL
                low_quality.add(c.fmt.name)
        else:
            c.measured["runs_tok_s"] = [throughput(c.measured, c.running, w)]
            c.measured["tok_s"] = c.measured["runs_tok_s"][0]
            c.status = "fits"
            passed.append(c)
    for r in range(args.confirm_rounds):  # near ties run again, interleaved: one run's tok/s is noisy here
        best_tok_s = max((c.measured["tok_s"] for c in passed), default=0.0)
        close = [c for c in passed if c.measured["tok_s"] >= (1 - CONFIRM_WITHIN) * best_tok_s]
        if len(close) < 2:
            break
        for c in close:
            m = run(c, f" #confirm{r + 1}", with_ref=False)
            if "error" in m or m["peak"] > budget:
                c.status = "failed: " + m["error"][:120] if "error" in m else f"over budget ({format_bytes(m['peak'])})"
                passed.remove(c)
                continue
            c.measured["runs_tok_s"].append(throughput(m, c.running, w))
            c.measured["tok_s"] = statistics.median(c.measured["runs_tok_s"])
            c.measured["peak"] = max(c.measured["peak"], m["peak"])
    everything = sorted(fits, key=rank_key) + misses
    for c in misses:
        c.status = "predicted over budget"
    if not passed:
        tried = [c for c in everything if c.measured and "error" not in c.measured]
        low = [c for c in tried if c.status.startswith("below quality")]
        closest = (min(low, key=lambda c: c.measured.get("kl", math.inf)) if low else
                   min(tried, key=lambda c: c.measured["peak"]) if tried else everything[0])
        write_outputs(out, everything, None, budget, w)
        raise UserError(f"no candidate passed verification within --memory {format_bytes(budget)} and "
                        f"--min-quality {args.min_quality}: the closest, {closest.name}, {closest.status}")
    best = max(passed, key=lambda c: c.measured["tok_s"])
    best.status = "chosen"
    command = "serve " + " ".join(best.serve_args() + extra)
    write_outputs(out, everything, best, budget, w, command)
    return {"command": command, "chosen": best.name, "budget": budget, "workload": vars(w),
            "predicted_peak": best.predicted["peak"], "measured_peak": best.measured["peak"],
            "tok_s": best.measured["tok_s"], "kl": best.measured.get("kl"), "top1": best.measured.get("top1"),
            "out": str(out), "candidates": [{"name": c.name, "status": c.status, "predicted": c.predicted,
                                             "measured": c.measured} for c in everything]}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = fit(args)
    except UserError as e:
        print(f"memfit fit: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print((Path(result["out"]) / "candidates.md").read_text())
        print(f"chosen: {result['command']}")
    return 0
