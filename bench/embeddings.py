"""The vocabulary tables quantized (serve --quantize-embeddings int8 / int4): quality and decode speed on a real
model.

    python bench/embeddings.py                       # Gemma 3 270M from `make real-model`
    python bench/embeddings.py --model DIR --tokens 4096

Quality, on held-out Shakespeare (the plays compress never calibrates on): mean per-token KL(fp32 || quantized
tables), top-1 agreement and perplexity, window by window (seqlen tokens each). int4 is the RTN of
`compress quantize --quantize-embeddings int4` (asymmetric groups of 32). Speed: SlotModel decode steps (batch
1 and 16, the serving engine's forward) on the fp32 model and on each quantized-table model, interleaved
rounds, medians. Writes bench/results/embeddings.md and .json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress import calib  # noqa: E402
from compress.evaluate import cpu_model, host_isa  # noqa: E402
from memfit.hf import load_pretrained, load_tokenizer  # noqa: E402
from memfit.runtime.embeddings import quantize_vocab_int8  # noqa: E402
from memfit.runtime.slot_model import Segment, SlotModel  # noqa: E402
from serve.loader import quantize_vocab_int4  # noqa: E402

RESULTS = ROOT / "bench" / "results"


@torch.inference_mode()
def quality(fp: torch.nn.Module, q: torch.nn.Module, tokens: torch.Tensor, seqlen: int) -> dict:
    kl_sum = agree = n = 0
    nll = {"fp32": 0.0, "q": 0.0}
    for start in range(0, len(tokens) - 1, seqlen):
        ids = tokens[start:start + seqlen + 1]
        if len(ids) < 2:
            break
        x, y = ids[:-1][None], ids[1:]
        lp = F.log_softmax(fp(x).logits[0].float(), -1)
        lq = F.log_softmax(q(x).logits[0].float(), -1)
        kl_sum += float((lp.exp() * (lp - lq)).sum())
        agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
        nll["fp32"] -= float(lp.gather(1, y[:, None]).sum())
        nll["q"] -= float(lq.gather(1, y[:, None]).sum())
        n += len(y)
    return {"tokens": n, "kl_mean": kl_sum / n, "top1_agreement": agree / n,
            "ppl_fp32": float(torch.exp(torch.tensor(nll["fp32"] / n))),
            "ppl": float(torch.exp(torch.tensor(nll["q"] / n)))}


def decode_ms(sm: SlotModel, batch: int, steps: int = 8, prompt: int = 32) -> float:
    """Median ms of a decode step of ``batch`` sequences (each prefilled with ``prompt`` tokens first)."""
    g = torch.Generator().manual_seed(batch)
    for s in range(batch):
        sm.forward(torch.randint(10, 1000, (prompt,), generator=g), [Segment(s, 0, prompt)])
    times = []
    for i in range(steps):
        ids = torch.randint(10, 1000, (batch,), generator=g)
        t0 = time.perf_counter()
        sm.forward(ids, [Segment(s, prompt + i, 1) for s in range(batch)])
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def real_model_args(argv: list[str] | None, doc: str, prog: str, rounds: int) -> argparse.Namespace | None:
    """The options of the real-model benchmarks (model, held-out tokens, window, rounds); None, with the error
    printed, where the model is missing."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".cache" / "models" / "gemma3-270m"))
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens for the quality numbers")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=rounds)
    a = ap.parse_args(argv)
    if not (Path(a.model) / "config.json").is_file():
        print(f"{prog}: error: no model at {a.model} (run `make real-model`)", file=sys.stderr)
        return None
    return a


KINDS = {"int8": quantize_vocab_int8, "int4": quantize_vocab_int4}


def main(argv: list[str] | None = None) -> int:
    a = real_model_args(argv, __doc__, "bench/embeddings.py", 3)
    if a is None:
        return 2
    torch.manual_seed(0)
    tok = load_tokenizer(a.model)
    tokens = calib.eval_tokens(tok, calib.default_eval_files(), a.tokens)
    fp = load_pretrained(a.model).eval()
    models, sizes, qual = {}, {}, {}
    for kind, quantize in KINDS.items():
        models[kind] = copy.deepcopy(fp)
        sizes[kind] = quantize(models[kind])
        t0 = time.perf_counter()
        qual[kind] = quality(fp, models[kind], tokens, a.seqlen)
        print(f"{kind}: quality on {qual[kind]['tokens']} held-out tokens ({time.perf_counter() - t0:.0f} s): "
              f"{json.dumps(qual[kind])}", flush=True)
    engines = {f"{k} tables": SlotModel(m, 16, 128, dense_kernel="auto", cpu_kernels="auto")
               for k, m in {"fp32": fp, **models}.items()}
    speed: dict[str, dict[int, list[float]]] = {k: {1: [], 16: []} for k in engines}
    for _ in range(a.rounds):  # interleaved: fp32, int8, int4, fp32, ...
        for name, sm in engines.items():
            for b in (1, 16):
                speed[name][b].append(decode_ms(sm, b))
    med = {k: {b: statistics.median(v) for b, v in d.items()} for k, d in speed.items()}
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": a.model,
              "host": f"{cpu_model()} ({host_isa()}), {torch.get_num_threads()} threads",
              "torch": torch.__version__, "tables_bytes": sizes, "quality": qual, "decode_ms_rounds": speed,
              "decode_ms_median": med}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "embeddings.json").write_text(json.dumps(result, indent=1) + "\n")
    fp_bytes = sizes["int8"]["before_bytes"]
    lines = ["# Vocabulary tables quantized (`serve --quantize-embeddings int8|int4`)", "",
             f"Run {result['date']} on {result['host']}, torch {result['torch']}. Model: `{a.model}`. "
             f"Command: `python bench/embeddings.py`.", "",
             f"Quality on {qual['int8']['tokens']} held-out tokens ({', '.join(calib.HELD_OUT)}), windows of "
             f"{a.seqlen}; perplexity of the fp32 model {qual['int8']['ppl_fp32']:.3f}. Tables: {fp_bytes / 2**20:.1f} "
             "MiB in fp32 (tied: one table).", "",
             "| tables | bytes (MiB) | / fp32 | mean per-token KL to fp32 | top-1 agreement | perplexity |",
             "|---|---:|---:|---:|---:|---:|"]
    for kind in KINDS:
        after, qk = sizes[kind]["after_bytes"], qual[kind]
        lines.append(f"| {kind} | {after / 2**20:.1f} | {after / fp_bytes:.3f} | {qk['kl_mean']:.5f} | "
                     f"{qk['top1_agreement']:.4f} | {qk['ppl']:.3f} |")
    lines += ["", "int8: one symmetric scale per row, lm_head and embedding share the codes (one table). int4: "
              "asymmetric groups of 32; the lm_head (int4 kernel pack) and the embedding rows are two copies.", "",
              f"Decode step (SlotModel, the serving engine's forward), median of {a.rounds} interleaved rounds "
              "of 8 steps:", "", "| batch | fp32 tables (ms) | int8 tables (ms) | int4 tables (ms) | int8 speed-up "
              "| int4 speed-up |", "|---:|---:|---:|---:|---:|---:|"]
    for b in (1, 16):
        f32, i8, i4 = (med[f"{k} tables"][b] for k in ("fp32", "int8", "int4"))
        lines.append(f"| {b} | {f32:.2f} | {i8:.2f} | {i4:.2f} | {f32 / i8:.2f}x | {f32 / i4:.2f}x |")
    (RESULTS / "embeddings.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
