"""Each architecture the packed engine runs, against Llama at the same size: is any of them slower per step?

    python bench/architectures.py [--rounds 3] [--layers 12] [--hidden 768]

Random models (no real checkpoint of GPT-2, GPT-NeoX or Phi-3 is installed here) of one width, depth and
vocabulary: llama (gated SiLU MLP, RMSNorm, the C++ layer loop), phi3 (fused projections split into Llama's),
phi3 with partial RoPE (0.75, Phi-4-mini's), gpt2 (Conv1D, learned positions, LayerNorm, GELU MLP) and
gpt_neox (head-interleaved q/k/v, partial RoPE 0.25, parallel residual). Their MLP widths are chosen so that
each has the parameters of the Llama (gated MLPs: 8/3 x hidden, non-gated: 4 x hidden). Measured on SlotModel
(serve's engine; memfit's kernels forced on, since "auto" times the panels per shape and may leave them off;
fp32): a decode step at batch 1 and 16 (after 32-token prompts) and a 256-token prefill chunk, interleaved
rounds, medians, and each as a ratio to Llama in the same run.
Writes bench/results/architectures.md and .json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.embeddings import decode_ms  # noqa: E402
from compress.evaluate import cpu_model, host_isa  # noqa: E402
from memfit.runtime.generic import make_runner  # noqa: E402
from memfit.runtime.slot_model import Segment, SlotModel  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VOCAB = 32768


def build(kind: str, hidden: int, layers: int) -> torch.nn.Module:
    import transformers as hf

    torch.manual_seed(0)
    heads = hidden // 64
    gated = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=heads, intermediate_size=hidden * 8 // 3 // 64 * 64,
                 max_position_embeddings=1024, tie_word_embeddings=False)
    if kind == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**gated)).eval()
    if kind.startswith("phi3"):
        rope = {"rope_type": "default", "rope_theta": 10000.0,
                **({"partial_rotary_factor": 0.75} if kind == "phi3-partial" else {})}
        return hf.Phi3ForCausalLM(hf.Phi3Config(**gated, rope_parameters=rope, pad_token_id=0)).eval()
    if kind == "gpt2":
        return hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads,
                                                n_positions=1024, tie_word_embeddings=False)).eval()
    if kind == "gpt_neox":
        return hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                                                      num_attention_heads=heads, intermediate_size=4 * hidden,
                                                      max_position_embeddings=1024)).eval()
    raise ValueError(kind)


KINDS = ["llama", "phi3", "phi3-partial", "gpt2", "gpt_neox"]


def prefill_ms(sm: SlotModel, n: int = 256) -> float:
    ids = torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(n))
    t0 = time.perf_counter()
    sm.forward(ids, [Segment(0, 0, n)])
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    a = ap.parse_args(argv)
    engines, params = {}, {}
    for kind in KINDS:
        model = build(kind, a.hidden, a.layers)
        params[kind] = sum(p.numel() for p in model.parameters())
        sm = make_runner(model, 16, 512, dense_kernel="on", cpu_kernels="on")  # "auto" may time panels out
        if not isinstance(sm, SlotModel):
            print(f"{kind}: not on the packed engine ({sm.reason})", file=sys.stderr)
            return 1
        engines[kind] = sm
        print(f"{kind}: {params[kind] / 1e6:.1f}M parameters, C++ layer loop: {sm.stack is not None}", flush=True)
    times: dict[str, dict[str, list[float]]] = {k: {"decode 1": [], "decode 16": [], "prefill 256": []}
                                                for k in KINDS}
    for _ in range(a.rounds):  # interleaved
        for kind, sm in engines.items():
            times[kind]["prefill 256"].append(prefill_ms(sm))
            times[kind]["decode 1"].append(decode_ms(sm, 1))
            times[kind]["decode 16"].append(decode_ms(sm, 16))
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in times.items()}
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "host": f"{cpu_model()} ({host_isa()}), {torch.get_num_threads()} threads", "torch": torch.__version__,
              "hidden": a.hidden, "layers": a.layers, "vocab": VOCAB, "params": params,
              "cpp_layer_loop": {k: engines[k].stack is not None for k in KINDS}, "ms_rounds": times, "ms_median": med}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "architectures.json").write_text(json.dumps(result, indent=1) + "\n")
    metrics = ["decode 1", "decode 16", "prefill 256"]
    lines = ["# Architectures on the packed engine, against Llama at the same size", "",
             f"Run {result['date']} on {result['host']}, torch {result['torch']}. Random models, hidden {a.hidden}, "
             f"{a.layers} layers, vocabulary {VOCAB}, fp32, memfit's kernels; median of {a.rounds} interleaved "
             "rounds. Command: `python bench/architectures.py`.", "",
             "| architecture | parameters | C++ layer loop | " + " | ".join(f"{m} (ms)" for m in metrics) + " | "
             + " | ".join(f"{m} / llama" for m in metrics) + " |", "|---|---:|---|" + "---:|" * 6]
    for k in KINDS:
        row = [f"{med[k][m]:.2f}" for m in metrics] + [f"{med[k][m] / med['llama'][m]:.2f}x" for m in metrics]
        lines.append(f"| {k} | {params[k] / 1e6:.1f}M | {'yes' if result['cpp_layer_loop'][k] else 'no'} | "
                     + " | ".join(row) + " |")
    (RESULTS / "architectures.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
