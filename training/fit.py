"""`memfit fit MODEL --for train --memory SIZE --recipe R.yaml`: the fastest way to run a training recipe within
a memory budget, chosen from measurements rather than guesses.

What trains stays the recipe's (data, block_size, global batch = batch_size x grad_accum, lr, ...). The knobs
chosen: precision, micro-batch (grad_accum = global / micro), checkpointing (none / auto / full), loss (chunked /
plain), activation offload (disk on CPU, cpu on CUDA), optimizer (adamw, adamw8bit where bitsandbytes works),
optimizer offload (CUDA only). LoRA, then QLoRA (CUDA), are tried only when nothing with the recipe's own method
fits: a quality change, so the output says so. How: probe processes (training.fit_child) -> a plan for every
candidate derived from them (training.fit_candidates, whose docstring says how) -> real runs of the best-ranked
candidates predicted to fit; one whose measured peak misses the budget is rejected; the fastest measured one
that fits is chosen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from memfit.errors import UserError, exit_on_user_error
from memfit.modeldir import check_model_dir
from memfit.sizes import parse_size
from training.config import TrainConfig, load_config
from training.fit_candidates import MARGIN, Candidate, Probe, divisors, enumerate_candidates, rank
from training.fit_report import markdown, shown, write_png, write_tables, write_text

KNOBS = ("precision", "batch_size", "grad_accum", "checkpointing", "activation_budget", "loss",
         "offload_activations", "optimizer", "optimizer_offload")
ROOT = Path(__file__).resolve().parent.parent
CONFIRM_WITHIN = 0.10
"""Verified candidates within this fraction of the fastest one's tok/s are run again before one is chosen: on
this 2-core host one 3-step run's tok/s varies by ~10%."""


@dataclasses.dataclass
class FitResult:
    """The outcome of one fit: what was chosen, from what."""

    budget: int
    """The --memory budget in bytes."""
    chosen: Candidate | None
    """The fastest verified candidate under budget (None: nothing fits)."""
    candidates: list[Candidate]
    """Every candidate, in verification order (methods in preference order, each ranked by expected speed)."""
    recipe: Path | None
    """The chosen recipe written under --out."""
    fallback: str
    """Why the recipe's own method (full / LoRA) was given up, when it was; empty otherwise."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train fit", description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="MODEL", help="model dir (replaces the recipe's model), or - for the recipe's own")
    p.add_argument("--memory", required=True, help="the budget: process RSS on CPU, GPU memory on CUDA (e.g. 6GiB)")
    p.add_argument("--recipe", required=True, help="training recipe YAML (configs/train/*.yaml)")
    p.add_argument("--out", default="runs/fit-train", help="where recipe.yaml, candidates.{json,md}, frontier.png go")
    p.add_argument("--verify-steps", type=int, default=3, help="optimizer steps per verification run (>= 2)")
    p.add_argument("--max-verify", type=int, default=4, help="top candidates to verify by a real run")
    p.add_argument("--confirm-rounds", type=int, default=1, help="more runs, interleaved, of the verified "
                   f"candidates within {CONFIRM_WITHIN:.0%} of the fastest before choosing (0: choose from one run)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override recipe keys, as with train")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    try:
        result = fit(args)
    except UserError as e:
        return exit_on_user_error("train fit", e)
    summary = json.loads((Path(args.out) / "candidates.json").read_text())
    if args.json:
        print(json.dumps(summary))
        return 0
    c = result.chosen
    if result.fallback:
        print(result.fallback)
    print(f"chosen: {c.label()}: measured peak {c.measured_peak / 2**20:.1f} MiB <= budget "
          f"{result.budget / 2**20:.1f} MiB, {c.measured_tok_s:.0f} tok/s")
    print(f"run it: {summary['command']}")
    rows = shown(result.candidates)
    print(markdown(result.candidates, rows))
    if len(rows) < len(result.candidates):
        print(f"({len(result.candidates) - len(rows)} more rows in {Path(args.out) / 'candidates.md'})")
    if summary.get("png_note"):
        print(summary["png_note"])
    return 0


def fit(args: argparse.Namespace) -> FitResult:
    budget = parse_size(args.memory, "--memory")
    if args.verify_steps < 2:
        raise UserError(f"--verify-steps must be >= 2 (tok/s is measured after step 1), got {args.verify_steps}")
    if args.max_verify < 1:
        raise UserError(f"--max-verify must be >= 1, got {args.max_verify}")
    if args.confirm_rounds < 0:
        raise UserError(f"--confirm-rounds must be >= 0, got {args.confirm_rounds}")
    raw, cfg = load_recipe(args.model, args.recipe, args.overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.yaml").unlink(missing_ok=True)  # a previous fit's choice must not outlive a failed one
    import torch  # after the input checks: bad input fails fast

    device = "cuda" if torch.cuda.is_available() else "cpu"
    limit = int(budget * (1 - MARGIN))
    cands: list[Candidate] = []
    fallback, chosen, methods = "", None, method_order(cfg, device)
    verify_cfgs: dict[str, TrainConfig] = {}
    # asked of the first probe only (importing bitsandbytes takes seconds)
    adamw8bit: tuple[bool, int, float] | None = None
    for method in methods:
        mcfg = with_method(cfg, method)
        mine: list[Candidate] = []
        for precision in precisions(device):
            try:
                probe = run_probe(dataclasses.replace(mcfg, precision=precision), method, out, limit,
                                  adamw8bit is None)
            except UserError as e:
                if method == methods[0] and precision == precisions(device)[0]:
                    raise  # the recipe as given does not run: that is the user's to fix
                print(f"skipping {method} {precision}: {e}", file=sys.stderr, flush=True)
                continue
            if adamw8bit is None:
                adamw8bit = (probe.adamw8bit, probe.adamw8bit_bytes, probe.adamw8bit_temp)
            probe.adamw8bit, probe.adamw8bit_bytes, probe.adamw8bit_temp = adamw8bit
            optimizers = ["adamw"] + (["adamw8bit"] if probe.adamw8bit else [])
            mine += enumerate_candidates(probe, mcfg, limit, optimizers)
        mine = rank(mine, cfg.loss)
        for c in mine:
            c.status = "not verified" if c.predicted_peak <= limit else "predicted over budget"
        cands += mine
        verify_cfgs[method] = mcfg
        chosen = verify(mine, mcfg, out, args.verify_steps, args.max_verify, budget, start=len(cands) - len(mine),
                        confirm_rounds=args.confirm_rounds)
        if chosen is not None:
            break
        if method != methods[-1] and mine:
            least, after = min(mine, key=lambda c: c.predicted_peak), methods[methods.index(method) + 1]
            fallback += (f"nothing with {method} fits {fmt(budget)} (least: {fmt(least.predicted_peak)} predicted for "
                         f"{least.label()}): falling back to {after}, which changes what trains (adapters only; "
                         "review lr and lora_* in the recipe). ")
            print(f"nothing with {method} fits: trying {after}", file=sys.stderr, flush=True)
    recipe_path = None
    summary: dict[str, Any] = {"recipe": args.recipe, "model": args.model, "budget": budget,
                               "budget_text": args.memory, "margin": MARGIN, "limit": limit, "device": device,
                               "verify_steps": args.verify_steps, "fallback": fallback.strip() if chosen else "",
                               "chosen": None, "command": None}
    if chosen is not None:
        recipe_path = out / "recipe.yaml"
        final = dataclasses.replace(verify_cfgs[chosen.method], **chosen.overrides()).validate()
        write_recipe(recipe_path, recipe_mapping(raw, final),
                     f"chosen by `memfit fit --for train --memory {args.memory}` from {args.recipe}: "
                     f"{chosen.label()} (see candidates.md)")
        summary.update(chosen=cands.index(chosen), command=f"train --config {recipe_path}")
    summary["png_note"] = write_png(out / "frontier.png", cands, budget, f"{args.recipe}, budget {args.memory}")
    write_tables(out, summary, cands)
    if chosen is None:
        raise UserError(nothing_fits(cands, budget, methods))
    return FitResult(budget, chosen, cands, recipe_path, fallback.strip())


def load_recipe(model: str, recipe: str, overrides: list[str]) -> tuple[dict[str, Any], TrainConfig]:
    """The recipe's own mapping (to write back in its order) and the validated config with MODEL and overrides."""
    path = Path(recipe)
    if not path.is_file():
        raise UserError(f"--recipe: {recipe} does not exist")
    extra = []
    if model != "-":
        check_model_dir(model, "MODEL")
        extra = [f"model_path={model}", "model_config=null"]
    cfg = load_config(recipe, [*overrides, *extra])  # refuses bad YAML and unknown keys, naming them
    raw = yaml.safe_load(path.read_text())
    if cfg.stages:
        raise UserError("stages: fit plans one trainable set; fit each stage's recipe (its trainable/freeze) "
                        "on its own")
    return raw if isinstance(raw, dict) else {}, cfg


def method_order(cfg: TrainConfig, device: str) -> list[str]:
    """The recipe's method, then the ones that train less (LoRA, then QLoRA on CUDA), only for a pretrained base:
    adapters on a model trained from scratch would learn next to nothing."""
    first = "qlora" if cfg.qlora else "lora" if cfg.lora else "full"
    order = ["full", "lora", "qlora"]
    order = order[order.index(first):]
    return [m for m in order if m == first or (cfg.model_path and (m != "qlora" or device == "cuda"))]


def with_method(cfg: TrainConfig, method: str) -> TrainConfig:
    return dataclasses.replace(cfg, lora=method in ("lora", "qlora"), qlora=method == "qlora")


def precisions(device: str) -> list[str]:
    """CUDA: bf16 (fp16 where the GPU lacks it) and fp32. CPU: fp32, plus bf16 only with native bf16 (AVX512-BF16
    or AMX): elsewhere autocast emulates it, ~6x slower (training.precision)."""
    import torch

    if device == "cuda":
        return ["bf16" if torch.cuda.is_bf16_supported() else "fp16", "fp32"]
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private in torch.cpu: absent means no
    native = any(getattr(torch.cpu, f, lambda: False)() for f in checks)
    return ["fp32", "bf16"] if native else ["fp32"]


def _child(args: list[str], log: Path) -> tuple[dict[str, Any] | None, str]:
    """Run training.fit_child; its last stdout line is JSON. Returns (result or None, why it failed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "training.fit_child", *args], capture_output=True, text=True, env=env)
    write_text(log, proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if result is not None and "error" not in result and proc.returncode == 0:
        return result, ""
    if result is not None and "error" in result:
        return None, result["error"]
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or [f"exit code {proc.returncode}"]
    return None, tail[0][-300:]


def run_probe(cfg: TrainConfig, method: str, out: Path, limit: int, check_8bit: bool) -> Probe:
    tag = f"{method}-{cfg.precision}"
    path = out / "probes" / f"{tag}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_recipe(path, asdict(dataclasses.replace(cfg, output_dir=str(out / "probes" / tag))))
    batches = divisors(cfg.batch_size * cfg.grad_accum)
    t0 = time.perf_counter()
    result, why = _child(["probe", str(path), "--batches", ",".join(map(str, batches)), "--plain-cap", str(limit)]
                         + ["--check-adamw8bit"] * check_8bit,
                         out / "probes" / f"{tag}.log")
    if result is None:
        raise UserError(f"{method} ({cfg.precision}): the memory probe failed: {why} (log: {out / 'probes'})")
    probe = Probe(method, result["precision"], result["device"], result["vocab"],
                  [tuple(t) for t in result["trainable"]], result["points"], adamw8bit=result["adamw8bit"],
                  load_peak=result["load_peak"], adamw8bit_bytes=result["adamw8bit_bytes"],
                  adamw8bit_temp=result["adamw8bit_temp"], hidden=result["hidden"])
    points = ", ".join(f"{p['loss']} x{p['batch_size']}" for p in probe.points)
    print(f"probe {tag}: base {fmt(probe.first['base'])}, loading peak {fmt(probe.load_peak)}, {points} "
          f"({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr, flush=True)
    return probe


def verification_order(ranked: list[Candidate]) -> list[Candidate]:
    """The candidates predicted to fit: the best-ranked of each checkpointing kind (none, auto, full) first, then
    the rest by rank. The speed score's recompute cost is a guess, and on CPU a wrong one (Gemma 3 270M, 4 x 256
    tokens: full checkpointing measured faster than none, its working set being smaller), so every kind gets a
    real run before a second plan of any kind does."""
    todo = [c for c in ranked if c.status == "not verified"]
    firsts: dict[str, Candidate] = {}
    for c in todo:
        if c.offload_activations == "none":
            firsts.setdefault(c.checkpointing, c)
    head = sorted(firsts.values(), key=todo.index)
    return head + [c for c in todo if c not in head]


def verify(ranked: list[Candidate], cfg: TrainConfig, out: Path, steps: int, max_verify: int, budget: int,
           start: int, confirm_rounds: int = 1) -> Candidate | None:
    """Real runs of the candidates predicted to fit in verification_order: max_verify of them, and past that (when
    none fit yet) on down the list until one does, at most 2 x max_verify runs. Then the ones within CONFIRM_WITHIN
    of the fastest run confirm_rounds more times, interleaved (a 2-core host is noisy): each one's tok/s is the
    median of its runs, its peak the highest. Returns the fastest that fit."""
    done, fits = 0, []
    for c in verification_order(ranked):
        if done >= max_verify and (fits or done >= 2 * max_verify):
            break
        done += 1
        print_run(c, start + ranked.index(c), f"{done}/{max_verify}",
                  run_candidate(c, cfg, out / "verify" / f"{start + ranked.index(c):03d}", steps, budget))
        if c.status == "fits":
            fits.append(c)
    for r in range(confirm_rounds):
        best = max((c.measured_tok_s or 0.0 for c in fits), default=0.0)
        close = [c for c in fits if (c.measured_tok_s or 0.0) >= (1 - CONFIRM_WITHIN) * best]
        if len(close) < 2:
            break
        for c in close:
            idx = start + ranked.index(c)
            print_run(c, idx, f"confirm {r + 1}/{confirm_rounds}",
                      run_candidate(c, cfg, out / "verify" / f"{idx:03d}-{r + 1}", steps, budget))
        fits = [c for c in fits if c.status == "fits"]
    if not fits:
        return None
    best_c = max(fits, key=lambda c: c.measured_tok_s or 0.0)
    best_c.status = "chosen"
    return best_c


def run_candidate(c: Candidate, cfg: TrainConfig, d: Path, steps: int, budget: int) -> tuple[float, str]:
    """One real run of c (training.fit_child run) in d; folds what it measured into c (tok/s: the median of
    c's runs, peak: the highest). Returns (seconds taken, why it failed or '')."""
    d.mkdir(parents=True, exist_ok=True)
    run_cfg = dataclasses.replace(cfg, **c.overrides(), output_dir=str(d / "run"), max_steps=max(cfg.max_steps,
                                  steps + 1), eval_every=10**9, save_every=10**9, log_every=10**9,
                                  eval_at_start=False).validate()
    write_recipe(d / "recipe.yaml", asdict(run_cfg))
    t0 = time.perf_counter()
    result, why = _child(["run", str(d / "recipe.yaml"), "--steps", str(steps)], d / "log.txt")
    shutil.rmtree(d / "run", ignore_errors=True)
    if result is None:
        c.status, c.note = "failed", why
        return time.perf_counter() - t0, why
    c.runs_tok_s.append(result["tok_s"])
    c.measured_peak = max(c.measured_peak or 0, result["peak"])
    c.measured_tok_s = statistics.median(c.runs_tok_s)
    c.status = "fits" if c.measured_peak <= budget else "over budget"
    return time.perf_counter() - t0, ""


def print_run(c: Candidate, idx: int, which: str, took: tuple[float, str]) -> None:
    seconds, why = took
    got = f"failed: {why}" if why else f"peak {fmt(c.measured_peak)}, {c.runs_tok_s[-1]:.0f} tok/s"
    print(f"verify #{idx} ({which}) {c.label()}: predicted {fmt(c.predicted_peak)}, {got}: {c.status} "
          f"({seconds:.0f} s)", file=sys.stderr, flush=True)


def nothing_fits(cands: list[Candidate], budget: int, methods: list[str]) -> str:
    least = min(cands, key=lambda c: c.predicted_peak)
    need = least.predicted_peak / (1 - MARGIN)
    msg = (f"--memory {fmt(budget)}: nothing fits ({', '.join(methods)} tried, {len(cands)} candidates). The "
           f"smallest predicted peak is {fmt(least.predicted_peak)} ({least.label()}): the smallest feasible budget "
           f"is about {round_up(need)}")
    measured = [c for c in cands if c.measured_peak is not None]
    if measured:
        best = min(measured, key=lambda c: c.measured_peak)
        msg += (f"; {len(measured)} predicted to fit measured over it, the least {fmt(best.measured_peak)} "
                f"({best.label()})")
    return msg


def recipe_mapping(raw: dict[str, Any], cfg: TrainConfig) -> dict[str, Any]:
    """The recipe's keys in its own order with the chosen values, then the knobs and anything else that differs
    from the defaults; None values dropped (model_config after MODEL, activation_budget without auto)."""
    values, defaults = asdict(cfg), asdict(TrainConfig())
    keys = [k for k in raw if k in values] + [k for k in KNOBS if k not in raw]
    keys += [k for k in values if k not in keys and values[k] != defaults[k]]
    return {k: values[k] for k in keys if values[k] is not None}


def write_recipe(path: Path, mapping: dict[str, Any], comment: str = "") -> None:
    head = f"# {comment}\n" if comment else ""
    write_text(path, head + yaml.safe_dump(mapping, sort_keys=False))


def fmt(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def round_up(n: float) -> str:
    """A budget a user would write (memfit.sizes.parse_size reads it): whole MiB, or tenths of a GiB."""
    if n < 2**30:
        return f"{math.ceil(n / 2**20)}MiB"
    return f"{math.ceil(n * 10 / 2**30) / 10:.1f}GiB"
