"""Activation memory and step time vs sequence length, checkpointing and precision (8-layer Llama).

Activation memory is measured with training.memory.ActivationMeter (bytes of distinct storages saved
for backward, parameters excluded); step time is the median forward+backward+AdamW step. Ratios are
against `checkpointing=none` measured in the same run.

Step time is CPU time of the process by default (`--clock cpu`) with one torch thread: on a shared
machine wall time mostly measures the neighbours (a 2-thread OpenMP step stalls whenever either
thread is descheduled), while CPU time is the compute the step costs. `--clock wall` for a quiet box.

    python bench/checkpointing.py [--seqs 256,512,1024] [--batch 1] [--repeats 2] [--threads 1]
Writes bench/results/checkpointing.md and .png.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from training.memory import ActivationMeter
from training.precision import resolve

MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)


def measure(seq: int, batch: int, checkpointing: str, precision: str, repeats: int,
            clock=time.process_time) -> tuple[int, float]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL)).train()
    model.config.use_cache = False
    if checkpointing == "full":
        model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prec = resolve(precision, torch.device("cpu"))
    x = torch.randint(0, MODEL["vocab_size"], (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = x[:, :-1], x[:, 1:]
    times, act = [], 0
    for i in range(repeats + 1):  # first step warms up allocator and kernels
        t0 = clock()
        with ActivationMeter(model) as meter, prec.autocast():
            logits = model(input_ids=inputs).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(clock() - t0)
        act = meter.bytes
    return act, statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="256,512,1024")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--out", default="bench/results/checkpointing")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    seqs = [int(s) for s in args.seqs.split(",")]
    rows = []
    for precision in args.precisions.split(","):
        for seq in seqs:
            base = None
            for ck in ("none", "full"):
                act, t = measure(seq, args.batch, ck, precision, args.repeats, clock)
                base = base or (act, t)
                rows.append(dict(precision=precision, seq=seq, checkpointing=ck, act_mib=act / 2**20, step_s=t,
                                 mem_cut=base[0] / act, time_ratio=t / base[1]))
                print(f"{precision} seq {seq:5d} {ck:4s}: activations {act / 2**20:8.1f} MiB  step {t:6.3f} s"
                      f"  cut {base[0] / act:5.2f}x  time {t / base[1]:4.2f}x", flush=True)
    header = (f"| precision | seq | checkpointing | activations (MiB) | step ({args.clock} s) | memory cut vs none | "
              "step time vs none |\n|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['precision']} | {r['seq']} | {r['checkpointing']} | {r['act_mib']:.1f} | {r['step_s']:.3f}"
                   f" | {r['mem_cut']:.2f}x | {r['time_ratio']:.2f}x |\n" for r in rows)
    model_line = (f"8-layer Llama (hidden {MODEL['hidden_size']}, vocab {MODEL['vocab_size']}), batch {args.batch}, "
                  f"{torch.get_num_threads()} torch thread(s), step = median {args.clock} time of {args.repeats} "
                  "steps after one warm-up.\n\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(model_line + header + body)
    print("\n" + header + body)
    plot(rows, out.with_suffix(".png"))
    target = [r for r in rows if r["seq"] == 512 and r["checkpointing"] == "full" and r["precision"] == "fp32"]
    if target:
        r = target[0]
        ok = r["mem_cut"] >= 4 and r["time_ratio"] <= 1.35
        print(f"target (fp32, seq 512): cut {r['mem_cut']:.2f}x >= 4x and time {r['time_ratio']:.2f}x <= 1.35x: "
              f"{'MET' if ok else 'MISSED'}")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for precision in sorted({r["precision"] for r in rows}):
        for ck, style in (("none", "-o"), ("full", "--s")):
            sel = [r for r in rows if r["precision"] == precision and r["checkpointing"] == ck]
            label = f"{precision}, checkpointing {ck}"
            a.plot([r["seq"] for r in sel], [r["act_mib"] for r in sel], style, label=label)
            b.plot([r["seq"] for r in sel], [r["step_s"] for r in sel], style, label=label)
    a.set(xlabel="sequence length", ylabel="activation memory (MiB)", title="Activation memory", xscale="log",
          yscale="log")
    b.set(xlabel="sequence length", ylabel="step time (s)", title="Step time", xscale="log", yscale="log")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
