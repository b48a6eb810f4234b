"""`memfit fit` on real models: is the plan it chooses as fast as the best hand configuration that fits, is
its predicted peak within 10% of the measured one, and does any run exceed the budget?

    make real-model                                  # Gemma 3 270M under .cache/models (and the corpus)
    python bench/fit.py                              # serve and train, the shipped model and Gemma 3 270M
    python bench/fit.py --only serve --models gemma --rounds 1

Serve, per model, workload concurrency=16, prompt=512, output=256 and fit's default quality bound (kl<=0.05 on
held-out text): `memfit fit --for serve` at 4 budgets; then, in interleaved rounds (every configuration once,
then again; medians), each chosen command line and every hand configuration of HAND_SERVE is measured by the
same verification run fit uses (serve.fit_probe: serve's own load and engine, its peak RSS with the load
included, the workload's throughput from its timed prefill and decode phases, KL to fp32). A hand configuration
counts for a budget when its measured peak is within it and it meets the quality bound.

Train, per model: `memfit fit --for train` at 4 budgets on the model's recipe, against HAND_TRAIN (measured by
the same short real run fit uses).

accelerate's `estimate-memory` reads the Hub only; its number is `calculate_maximum_sizes` of the empty model
at the dtype, which is called here on the same model built on the meta device. Writes bench/results/fit.md,
fit.json and fit.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress.evaluate import cpu_model, host_isa  # noqa: E402
from memfit.modeldir import atomic_file  # noqa: E402
from memfit.sizes import format_bytes, parse_size  # noqa: E402

RESULTS = ROOT / "bench" / "results"
WORK = ROOT / ".cache" / "bench" / "fit"
MODELS = {"shipped": ROOT / "models" / "shakespeare-llama", "gemma": ROOT / ".cache" / "models" / "gemma3-270m"}
QUANTIZED = {"gemma": [ROOT / ".cache" / "bench" / "gemma3-270m-gptq4"]}  # used where present
WORKLOAD = {"concurrency": 16, "prompt": 512, "output": 256}
SERVE_BUDGETS = {"shipped": ["425MiB", "450MiB", "480MiB", "1GiB"], "gemma": ["1.2GiB", "1.6GiB", "2GiB", "3GiB"]}
# what an engineer writes by hand: serve's defaults (prefill chunk 256) at the workload's concurrency and KV,
# one weight format each
HAND_SERVE = {"fp32": ["--dtype", "fp32"], "bf16": ["--dtype", "bf16"],
              "int8": ["--quantize", "int8", "--dtype", "fp32"],
              "int8 + int8 vocab": ["--quantize", "int8", "--quantize-embeddings", "int8", "--dtype", "fp32"]}


def accelerate_estimate(model: Path, dtype_bytes: float) -> int:
    import torch
    from accelerate.utils import calculate_maximum_sizes

    from serve.placement import meta_model

    total, _largest = calculate_maximum_sizes(meta_model(str(model), torch.float32))
    return int(total * dtype_bytes / 4)


def hand_serve_configs(name: str, model: Path) -> dict[str, list[str]]:
    from serve import fit_predict as fp

    config = fp.read_model_config(str(model))
    seq = WORKLOAD["prompt"] + WORKLOAD["output"]
    lay = fp.kv_layout(config, 4, "auto", 16, seq)  # the workload's blocks, as fit sizes its own (fp32 KV)
    kv = WORKLOAD["concurrency"] * lay.seq_blocks(seq, 256) * lay.bytes_per_block
    common = ["--max-batch", str(WORKLOAD["concurrency"]), "--max-seq-len", str(seq), "--prefill-chunk", "256",
              "--kv-cache-memory", str(kv)]
    out = {label: ["--model", str(model), *flags, *common] for label, flags in HAND_SERVE.items()}
    for q in QUANTIZED.get(name, []):
        if q.is_dir():
            out[f"4-bit {q.name}"] = ["--model", str(q), *common]
    return out


def run_serve(name: str, model: Path, rounds: int) -> dict:
    from serve import fit as serve_fit
    from serve.fit_quality import make_reference, quality_files

    work = WORK / name / "serve"
    work.mkdir(parents=True, exist_ok=True)
    quality = serve_fit.parse_quality(serve_fit.DEFAULT_QUALITY)
    ref = str(make_reference(str(model), quality_files(None), 4, 64, work / "reference.safetensors"))
    chosen: dict[str, dict] = {}
    for budget in SERVE_BUDGETS[name]:
        argv = [str(model), "--memory", budget, "--workload", ",".join(f"{k}={v}" for k, v in WORKLOAD.items()),
                "--out", str(work / f"fit-{budget}"), "--measurements", str(work / "measurements.json"), "--json"]
        quantized = [str(q) for q in QUANTIZED.get(name, []) if q.is_dir()]
        if quantized:
            argv += ["--quantized", *quantized]
        t0 = time.perf_counter()
        result = _json_main(serve_fit.main, argv)
        result["fit_s"] = time.perf_counter() - t0
        chosen[budget] = result
        print(f"[{name} serve {budget}] {result.get('chosen') or result.get('error')}", flush=True)
    configs = hand_serve_configs(name, model)
    for budget, r in chosen.items():
        if "command" in r:
            configs[f"fit@{budget}"] = r["command"].split()[1:]
    seen: dict[str, str] = {}  # one measurement per distinct command line
    measured: dict[str, list[dict]] = {}
    for rnd in range(rounds):
        for label, args in configs.items():
            key = " ".join(args)
            if key in seen and seen[key] != label:
                continue
            seen[key] = label
            running = int(args[args.index("--max-batch") + 1])
            m = serve_fit.probe(args, ["--running", str(running), "--prompt", str(WORKLOAD["prompt"]),
                                       "--decode-steps", "64", "--ref", ref])
            if "error" not in m:
                m["tok_s"] = serve_fit.throughput(m, running, serve_fit.Workload(**WORKLOAD))
            measured.setdefault(key, []).append(m)
            print(f"[{name} serve round {rnd + 1}] {label}: peak {format_bytes(m.get('peak', 0))} "
                  f"tok/s {m.get('tok_s', 0):.1f} kl {m.get('kl', float('nan')):.4f}", flush=True)
    summary = {key: _median(ms) for key, ms in measured.items()}
    rows = []
    for budget, r in chosen.items():
        b = parse_size(budget, "budget")
        hand = {label: summary[" ".join(args)] for label, args in configs.items()
                if not label.startswith("fit@") and " ".join(args) in summary}
        fitting = {label: m for label, m in hand.items()
                   if "tok_s" in m and m["peak_max"] <= b and quality.misses(m) is None}
        best_label = max(fitting, key=lambda k: fitting[k]["tok_s"]) if fitting else None
        row = {"budget": budget, "chosen": r.get("chosen"), "error": r.get("error"), "fit_s": r["fit_s"],
               "best_hand": best_label, "best_hand_tok_s": fitting[best_label]["tok_s"] if best_label else None}
        if "command" in r:
            m = summary[" ".join(r["command"].split()[1:])]
            fmt_bytes = 4 if "fp32" in r["chosen"] else 2 if "bf16" in r["chosen"] else 1 if "int8" in r[
                "chosen"] else 0.5
            row |= {"predicted_peak": r["predicted_peak"], "measured_peak": m.get("peak_max"),
                    "tok_s": m.get("tok_s"), "kl": m.get("kl"),
                    "prediction_error": (r["predicted_peak"] - m["peak_max"]) / m["peak_max"],
                    "within_budget": m["peak_max"] <= b,
                    "accelerate_estimate": accelerate_estimate(model, fmt_bytes),
                    "ratio_vs_best_hand": m["tok_s"] / row["best_hand_tok_s"] if best_label else None}
            row["accelerate_error"] = (row["accelerate_estimate"] - m["peak_max"]) / m["peak_max"]
        rows.append(row)
    return {"rows": rows, "configs": {label: summary.get(" ".join(a)) for label, a in configs.items()},
            "commands": {label: " ".join(a) for label, a in configs.items()}}


def _median(ms: list[dict]) -> dict:
    ok = [m for m in ms if "error" not in m]
    if not ok:
        return ms[-1]
    out = {k: statistics.median(m[k] for m in ok) for k in ("tok_s", "prefill_s", "decode_step_s", "peak")}
    out["peak_max"] = max(m["peak"] for m in ok)  # the budget check: the worst round
    for k in ("kl", "top1"):
        if k in ok[0]:
            out[k] = ok[0][k]
    return out


def _json_main(main, argv: list[str]) -> dict:
    """Run a fit ``main(argv + --json)`` in this process and return its JSON (or its error line)."""
    import contextlib
    import io

    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = main(argv)
    if rc != 0:
        return {"error": err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {rc}"}
    return json.loads(buf.getvalue())


def serve_markdown(name: str, res: dict) -> str:
    lines = [f"### {name}: serve (workload {WORKLOAD}, quality kl<=0.05)", "",
             "| budget | chosen | predicted peak | measured peak | error | within | tok/s | best hand (tok/s) | "
             "ratio | accelerate est. (error) | fit time |", "|---|---|---:|---:|---:|---|---:|---|---:|---:|---:|"]
    for r in res["rows"]:
        if r.get("chosen") is None:
            lines.append(f"| {r['budget']} | {r['error']} | | | | | | {r['best_hand']} | | | {r['fit_s']:.0f} s |")
            continue
        hand = f"{r['best_hand']} ({r['best_hand_tok_s']:.1f})" if r["best_hand"] else "none fits"
        ratio = f"{r['ratio_vs_best_hand']:.2f}x" if r["ratio_vs_best_hand"] else ""
        lines.append(f"| {r['budget']} | {r['chosen']} | {format_bytes(r['predicted_peak'])} | "
                     f"{format_bytes(r['measured_peak'])} | {r['prediction_error']:+.1%} | "
                     f"{'yes' if r['within_budget'] else 'NO'} | {r['tok_s']:.1f} | {hand} | {ratio} | "
                     f"{format_bytes(r['accelerate_estimate'])} ({r['accelerate_error']:+.0%}) | {r['fit_s']:.0f} s |")
    lines += ["", "configurations measured (medians; peak: worst round):", "",
              "| configuration | peak | tok/s | KL | command |", "|---|---:|---:|---:|---|"]
    for label, m in res["configs"].items():
        if m is None:
            continue
        lines.append(f"| {label} | {format_bytes(m.get('peak_max', 0))} | {m.get('tok_s', 0):.1f} | "
                     f"{m.get('kl', float('nan')):.4f} | `{res['commands'][label]}` |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Per model and job: the chosen plan's throughput next to the best fitting hand configuration's, per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, v) for k, v in results.items() if isinstance(v, dict) and "rows" in v]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (key, res) in zip(axes[0], panels, strict=True):
        rows = res["rows"]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r.get("tok_s") or 0 for r in rows], 0.4, label="memfit fit")
        ax.bar([i + 0.2 for i in x], [r.get("best_hand_tok_s") or 0 for r in rows], 0.4, label="best hand config")
        ax.set_xticks(list(x), [r["budget"] for r in rows])
        ax.set_title(key, fontsize=9)
        ax.set_ylabel("tok/s" if "serve" in key else "train tok/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["serve", "train"], default=None)
    p.add_argument("--models", default="shipped,gemma")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reuse-fits", action="store_true", help="train: take each budget's fit from an earlier run's "
                   "candidates.json and only measure the grid (the fit's time is then not reported)")
    args = p.parse_args()
    # results accumulate in fit.json by "model/job", so parts can be run (and rerun) separately
    path = RESULTS / "fit.json"
    results: dict = json.loads(path.read_text()) if path.is_file() else {}
    for name in args.models.split(","):
        model = MODELS[name]
        if not model.is_dir():
            print(f"skip {name}: {model} missing (make real-model)")
            continue
        for job in ("serve", "train"):
            if args.only not in (None, job):
                continue
            if job == "serve":
                res = run_serve(name, model, args.rounds)
            else:
                from bench.fit_train import run_train

                res = run_train(name, model, args.rounds, args.reuse_fits)
            res |= {"host": f"{cpu_model()} ({host_isa()})", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "rounds": args.rounds}
            results[f"{name}/{job}"] = res
            RESULTS.mkdir(parents=True, exist_ok=True)
            atomic_file(path, lambda tmp: tmp.write_text(json.dumps(results, indent=1, default=str)))
            write_report(results)
    return 0


def write_report(results: dict) -> None:
    from bench.fit_train import train_markdown

    md = ["# memfit fit on real models", "", "Written by `python bench/fit.py` (see its docstring for the method). "
          "What changed after a run, and why: [fit_history.md](fit_history.md).", ""]
    for key, res in results.items():
        name, job = key.split("/")
        md.append(f"host: {res['host']}, {res['date']}, {res['rounds']} round(s)\n")
        md.append(serve_markdown(name, res) if job == "serve" else train_markdown(name, res))
    (RESULTS / "fit.md").write_text("\n".join(md))
    plot(results, RESULTS / "fit.png")
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
