"""bench/fit.py's training half: `memfit fit --for train` at 4 budgets per model against HAND_TRAIN, a fixed grid of
the knobs an engineer sets by hand, each run by the same short real run fit verifies with (training.fit_child
run: the training loop for VERIFY_STEPS optimizer steps, peak RSS with the load included, tok/s after step 1)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

from memfit.sizes import format_bytes, parse_size

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".cache" / "bench" / "fit"
RECIPES = {"shipped": ("configs/train/shakespeare.yaml", []),
           # Gemma 3 270M at 4 x 256 tokens a step: the recipe's 16 x 1024 takes minutes a step on 2 cores
           "gemma": ("configs/train/gemma3_full.yaml", ["block_size=256", "batch_size=4", "grad_accum=1"])}
TRAIN_BUDGETS = {"shipped": ["560MiB", "700MiB", "900MiB", "1.5GiB"], "gemma": ["3GiB", "5GiB", "6.5GiB", "8GiB"]}
VERIFY_STEPS = 3


def hand_grid(global_batch: int) -> dict[str, dict]:
    """The recipe as written, and the usual hand edits of it: checkpoint everything, halve or quarter the
    micro-batch (accumulating to the same global batch), the 8-bit optimizer."""
    half, quarter = max(1, global_batch // 2), max(1, global_batch // 4)
    return {"recipe as written": {},
            "checkpointing full": {"checkpointing": "full", "activation_budget": None},
            f"micro-batch {half}": {"batch_size": half, "grad_accum": global_batch // half},
            f"micro-batch {quarter} + checkpointing full": {"batch_size": quarter,
                                                            "grad_accum": global_batch // quarter,
                                                            "checkpointing": "full", "activation_budget": None},
            "adamw8bit": {"optimizer": "adamw8bit"}}


def _run(recipe: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "training.fit_child", "run", str(recipe), "--steps", str(VERIFY_STEPS)],
                       capture_output=True, text=True, cwd=ROOT)
    lines = p.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        out = {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][-200:]}
    return out


def run_train(name: str, model: Path, rounds: int, reuse_fits: bool = False) -> dict:
    """``reuse_fits``: take each budget's fit from its candidates.json of an earlier run (its time not known)."""
    from bench.fit import _json_main
    from training import fit as train_fit

    recipe, overrides = RECIPES[name]
    work = WORK / name / "train"
    work.mkdir(parents=True, exist_ok=True)
    chosen: dict[str, dict] = {}
    for budget in TRAIN_BUDGETS[name]:
        import time

        t0 = time.perf_counter()
        done = work / f"fit-{budget}" / "candidates.json"
        if reuse_fits and done.is_file():
            chosen[budget] = json.loads(done.read_text()) | {"fit_s": None}
            continue
        r = _json_main(train_fit.main, [str(model), "--memory", budget, "--recipe", recipe, "--out",
                                        str(work / f"fit-{budget}"), "--verify-steps", str(VERIFY_STEPS),
                                        "--max-verify", "3", "--json", *overrides])
        r["fit_s"] = time.perf_counter() - t0
        chosen[budget] = r
        c = r["candidates"][r["chosen"]] if r.get("chosen") is not None else None
        print(f"[{name} train {budget}] {c and _label(c) or r.get('error')}", flush=True)
    raw, cfg = train_fit.load_recipe(str(model), recipe, overrides)
    global_batch = cfg.batch_size * cfg.grad_accum
    configs = {label: knobs for label, knobs in hand_grid(global_batch).items()}
    for budget, r in chosen.items():
        if r.get("chosen") is not None:
            c = r["candidates"][r["chosen"]]
            configs[f"fit@{budget}"] = {k: c[k] for k in train_fit.KNOBS} | {"lora": c["method"] != "full",
                                                                              "qlora": c["method"] == "qlora"}
    measured: dict[str, list[dict]] = {}
    for rnd in range(rounds):
        for label, knobs in configs.items():
            d = work / "hand" / label.replace(" ", "_").replace("@", "-")
            d.mkdir(parents=True, exist_ok=True)
            run_cfg = replace(cfg, **knobs, output_dir=str(d / "run"), max_steps=VERIFY_STEPS + 1,
                              eval_every=10**9, save_every=10**9, log_every=10**9, eval_at_start=False).validate()
            train_fit.write_recipe(d / "recipe.yaml", asdict(run_cfg))
            m = _run(d / "recipe.yaml")
            shutil.rmtree(d / "run", ignore_errors=True)  # the next round's run starts fresh
            measured.setdefault(label, []).append(m)
            print(f"[{name} train round {rnd + 1}] {label}: peak {format_bytes(m.get('peak', 0))} "
                  f"tok/s {m.get('tok_s') or 0:.0f} {m.get('error', '')}", flush=True)
    summary = {}
    for label, ms in measured.items():
        ok = [m for m in ms if "error" not in m and m.get("tok_s")]
        summary[label] = {"tok_s": statistics.median(m["tok_s"] for m in ok), "peak_max": max(m["peak"] for m in ok)} \
            if ok else {"error": ms[-1].get("error")}
    rows = []
    for budget, r in chosen.items():
        b = parse_size(budget, "budget")
        fitting = {k: v for k, v in summary.items() if not k.startswith("fit@") and "tok_s" in v
                   and v["peak_max"] <= b}
        best = max(fitting, key=lambda k: fitting[k]["tok_s"]) if fitting else None
        row = {"budget": budget, "fit_s": r["fit_s"], "best_hand": best,
               "best_hand_tok_s": fitting[best]["tok_s"] if best else None, "error": r.get("error"),
               "chosen": None}
        if r.get("chosen") is not None:
            c, m = r["candidates"][r["chosen"]], summary.get(f"fit@{budget}", {})
            row |= {"chosen": _label(c), "predicted_peak": c["predicted_peak"], "fit_measured_peak": c["measured_peak"],
                    "measured_peak": m.get("peak_max"), "tok_s": m.get("tok_s"), "fallback": r.get("fallback")}
            if m.get("peak_max"):
                row["prediction_error"] = (c["predicted_peak"] - m["peak_max"]) / m["peak_max"]
                row["within_budget"] = m["peak_max"] <= b and c["measured_peak"] <= b
                row["accelerate_estimate"] = _accelerate_adam(model)
                row["accelerate_error"] = (row["accelerate_estimate"] - m["peak_max"]) / m["peak_max"]
            if best and m.get("tok_s"):
                row["ratio_vs_best_hand"] = m["tok_s"] / row["best_hand_tok_s"]
        rows.append(row)
    return {"recipe": recipe, "overrides": overrides, "rows": rows, "configs": summary,
            "knobs": {k: v for k, v in configs.items()}}


def _label(c: dict) -> str:
    ck = c["checkpointing"] + (f" ({c['activation_budget'] // 2**20} MiB)" if c.get("activation_budget") else "")
    off = f" offload {c['offload_activations']}" if c["offload_activations"] != "none" else ""
    return (f"{c['method']} {c['precision']} {c['batch_size']}x{c['grad_accum']} ckpt {ck} {c['loss']} "
            f"{c['optimizer']}{off}")


def _secs(s: float | None) -> str:
    return "earlier run" if s is None else f"{s:.0f} s"


def _accelerate_adam(model: Path) -> int:
    """accelerate estimate-memory's "Training using Adam" row: 4 x the fp32 model (weights, gradients, 2 moments)."""
    from bench.fit import accelerate_estimate

    return 4 * accelerate_estimate(model, 4)


def train_markdown(name: str, res: dict) -> str:
    lines = [f"### {name}: train ({res['recipe']} {' '.join(res['overrides'])}, {VERIFY_STEPS}-step runs)", "",
             "| budget | chosen | predicted peak | measured peak | error | within | tok/s | best hand (tok/s) | "
             "ratio | accelerate Adam est. (error) | fit time |",
             "|---|---|---:|---:|---:|---|---:|---|---:|---:|---:|"]
    for r in res["rows"]:
        if r["chosen"] is None or r.get("measured_peak") is None:
            lines.append(f"| {r['budget']} | {r['chosen'] or r['error']} | | | | | | {r['best_hand']} | | | "
                         f"{_secs(r['fit_s'])} |")
            continue
        hand = f"{r['best_hand']} ({r['best_hand_tok_s']:.0f})" if r["best_hand"] else "none fits"
        ratio = f"{r['ratio_vs_best_hand']:.2f}x" if r.get("ratio_vs_best_hand") else ""
        lines.append(f"| {r['budget']} | {r['chosen']} | {format_bytes(r['predicted_peak'])} | "
                     f"{format_bytes(r['measured_peak'])} | {r['prediction_error']:+.1%} | "
                     f"{'yes' if r['within_budget'] else 'NO'} | {r['tok_s']:.0f} | {hand} | {ratio} | "
                     f"{format_bytes(r['accelerate_estimate'])} ({r['accelerate_error']:+.0%}) | {_secs(r['fit_s'])} |")
    lines += ["", "configurations measured (medians; peak: worst round):", "", "| configuration | peak | tok/s |",
              "|---|---:|---:|"]
    for label, m in res["configs"].items():
        if "error" in m:
            lines.append(f"| {label} | failed: {m['error']} | |")
        else:
            lines.append(f"| {label} | {format_bytes(m['peak_max'])} | {m['tok_s']:.0f} |")
    return "\n".join(lines) + "\n"
