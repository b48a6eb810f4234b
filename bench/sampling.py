"""Sampling cost per token on a real model's logits: serve's sampler against the direct definition.

    python bench/sampling.py                      # Gemma 3 270M from `make real-model` (262,144-token vocabulary)
    python bench/sampling.py --model DIR --tokens 256 --rounds 5

The logits are the model's own next-token logits over held-out Shakespeare (`--tokens` positions, windows of
`--seqlen`). Each request setting (temperature 1, the OpenAI default; temperature 0.8 with top-p 0.95; top-k 50;
min-p 0.05) is timed per token two ways, interleaved by round, medians:
- memfit: `serve.sampling.SamplerState.sample` (one uniform against block sums; top-p by a growing top-k);
- definition: softmax, top-p over a full descending sort, then `torch.multinomial` (serve's sampler before
  2026-12-07, and what a plain PyTorch server writes).
Both sample the same distribution: the bench checks that their top-p supports are the same sets on every row.
The greedy decode step of the same model (bf16 weights, batch 1) is timed alongside for scale. Writes
bench/results/sampling.md and .json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.embeddings import real_model_args  # noqa: E402
from compress import calib  # noqa: E402
from compress.evaluate import host_isa  # noqa: E402
from memfit.hf import load_pretrained, load_tokenizer  # noqa: E402
from memfit.runtime.slot_model import Segment, SlotModel  # noqa: E402
from serve.sampling import SamplerState, SamplingParams, _top_p  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SETTINGS = {"temperature 1": {"temperature": 1.0}, "temperature 0.8, top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
            "top-k 50": {"top_k": 50}, "min-p 0.05": {"min_p": 0.05}}


def by_definition(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """The sampling distribution written out directly: full softmax, full sort for top-p, torch.multinomial."""
    x = (logits - logits.max()) / p.temperature
    if p.top_k and 0 < p.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        cum = torch.cumsum(sp, dim=-1)
        probs = torch.zeros_like(probs).scatter_(0, si, sp.masked_fill((cum - sp) > p.top_p * cum[-1], 0.0))
    return int(torch.multinomial(probs, 1, generator=gen))


def top_p_set_by_sort(probs: torch.Tensor, top_p: float) -> set[int]:
    sp, si = torch.sort(probs, descending=True)
    before = torch.cumsum(sp.double(), 0) - sp.double()
    return set(si[before <= top_p * float(probs.sum())].tolist())


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    a = real_model_args(argv, __doc__, "bench/sampling.py", 5)
    if a is None:
        return 2
    tok = load_tokenizer(a.model)
    ids = torch.as_tensor(calib.eval_tokens(tok, calib.default_eval_files(), min(a.tokens, 256)))
    model = load_pretrained(a.model).eval()
    rows = torch.cat([model(ids[i:i + a.seqlen][None]).logits[0].float() for i in range(0, len(ids), a.seqlen)])
    print(f"{rows.shape[0]} rows of {rows.shape[1]} logits", flush=True)
    same = all(set(_top_p(torch.softmax(r / 0.8, -1), 0.95)[1].tolist()) == top_p_set_by_sort(
        torch.softmax(r / 0.8, -1), 0.95) for r in rows)
    sm = SlotModel(model, 1, 256, dense_kernel="auto", cpu_kernels="on", bf16_weights=True)
    sm.forward(ids[:64], [Segment(0, 0, 64)])
    times: dict[str, dict[str, list[float]]] = {k: {"memfit": [], "definition": [], "step": []} for k in SETTINGS}
    for _ in range(a.rounds):
        for name, kw in SETTINGS.items():
            p = SamplingParams(max_tokens=1, seed=0, **kw)
            st, gen = SamplerState(p, [], rows.shape[1]), torch.Generator().manual_seed(0)
            t0 = time.perf_counter()
            for r in rows:
                st.sample(r)
            t1 = time.perf_counter()
            for r in rows:
                by_definition(r, p, gen)
            t2 = time.perf_counter()
            for i in range(8):
                sm.forward(ids[64 + i:65 + i], [Segment(0, 64 + i, 1)])
            t3 = time.perf_counter()
            times[name]["memfit"].append((t1 - t0) / len(rows) * 1e3)
            times[name]["definition"].append((t2 - t1) / len(rows) * 1e3)
            times[name]["step"].append((t3 - t2) / 8 * 1e3)
    med = {k: {w: statistics.median(v) for w, v in d.items()} for k, d in times.items()}
    data = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": a.model, "host":
            f"{host_isa()}, {torch.get_num_threads()} threads", "rows": rows.shape[0], "vocab": rows.shape[1],
            "rounds": a.rounds, "top_p_sets_equal": same, "ms": times, "median_ms": med}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sampling.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = ["# Sampling cost per token (serve.sampling)", "",
             f"Run {data['date']} on {data['host']}, torch {torch.__version__}. Model `{a.model}`: {data['rows']} "
             f"rows of its next-token logits ({data['vocab']} tokens) over held-out text. Command: "
             f"`python bench/sampling.py`. Medians of {a.rounds} interleaved rounds. Top-p 0.95 supports (temperature "
             f"0.8) of memfit's growing top-k and a full sort are the same sets on every row: {same}.", "",
             "| request setting | memfit (ms/token) | definition: sort + multinomial (ms/token) | speed-up | "
             "greedy decode step, bf16, batch 1 (ms) |", "|---|---:|---:|---:|---:|"]
    for k, m in med.items():
        lines.append(f"| {k} | {m['memfit']:.3f} | {m['definition']:.3f} | {m['definition'] / m['memfit']:.1f}x | "
                     f"{m['step']:.1f} |")
    (RESULTS / "sampling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
