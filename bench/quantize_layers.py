"""Why 4-bit GPTQ can lose to RTN in perplexity while winning everywhere else: a per-Linear check.

    OMP_NUM_THREADS=1 python bench/quantize_layers.py [--model models/shakespeare-llama] [--bits 4]

1. Layer-wise objective: for every Linear, GPTQ's and RTN's output error tr(dW H dW^T) on the Hessian of its
   real calibration inputs (taken true-sequentially, after the earlier Linears and layers were quantized), and
   on the held-out plays' inputs in the fp32 model (per token: the share of tokens where GPTQ's error is lower).
2. Perplexity sensitivity: the fp32 model with only one group of Linears (one layer, or one kind across layers)
   replaced by its RTN or GPTQ copy; the held-out ppl change of each. If these single swaps move ppl by more
   than the whole model's 4-bit change, and either way, ppl at this scale ranks methods by chance.
Writes bench/results/quantize_layers.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress import calib, gptq  # noqa: E402
from compress.calib import Calibration  # noqa: E402
from compress.evaluate import format_table, perplexity  # noqa: E402
from compress.loader import load  # noqa: E402
from compress.quant import QuantArgs  # noqa: E402
from compress.quantize import QuantizeOptions, quantize_model  # noqa: E402
from compress.rtn import rtn  # noqa: E402
from memfit.hf import load_pretrained, load_tokenizer  # noqa: E402

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/shakespeare-llama")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=30000)
    ap.add_argument("--heldout-tokens", type=int, default=4096, help="held-out tokens for the per-token check")
    ap.add_argument("--work", default="out/bench-quantize-layers")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    tok = load_tokenizer(a.model)
    real = gptq.gptq
    calib_err: dict[int, list[float]] = {}

    def spy(w, H, args, **kw):  # GPTQ's quantize_layer calls gptq.gptq once per Linear, in order
        q = real(w, H, args, **kw)
        r = rtn(w, args)
        calib_err[len(calib_err)] = [float(torch.einsum("oi,ij,oj->", w - x, H, w - x)) for x in
                                     (r.dequantize(), q.dequantize())]
        return q

    gptq.gptq = spy
    try:
        opt = QuantizeOptions(bits=a.bits, group_size=128, method="gptq", sym=False, progress=False,
                              calibration=Calibration(tuple(calib.default_calib_files()), a.calib_samples))
        quantize_model(a.model, Path(a.work), opt)
    finally:
        gptq.gptq = real
    fp = load_pretrained(a.model).eval()
    q = load(a.work, backend="dequant")
    names = [n for n, m in fp.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    W = {n: fp.get_submodule(n).weight.data.clone() for n in names}
    G = {n: q.get_submodule(n).dequantized_weight().float() for n in names}
    # RTN copy with the same per-layer group size as the GPTQ output (down_proj falls back to 64)
    R = {n: rtn(W[n], QuantArgs(a.bits, q.get_submodule(n).group_size, False)).dequantize() for n in names}

    # held-out inputs of every Linear in the fp32 model
    held = calib.eval_tokens(tok, calib.default_eval_files(), a.max_tokens)
    X: dict[str, torch.Tensor] = {}
    hooks = [fp.get_submodule(n).register_forward_pre_hook(
        lambda _m, x, n=n: X.__setitem__(n, x[0].reshape(-1, x[0].shape[-1]))) for n in names]
    with torch.no_grad():
        fp(input_ids=held[: a.heldout_tokens // 512 * 512].view(-1, 512))
    for h in hooks:
        h.remove()
    rows = []
    for i, n in enumerate(names):
        er, eg = (((X[n] @ (W[n] - D[n]).t()) ** 2).sum(1) for D in (R, G))
        rows.append({"linear": n.removeprefix("model.layers."), "calib_rtn": f"{calib_err[i][0]:.4g}",
                     "calib_gptq": f"{calib_err[i][1]:.4g}", "calib_ratio": f"{calib_err[i][1] / calib_err[i][0]:.3f}",
                     "heldout_ratio": f"{eg.mean() / er.mean():.3f}",
                     "heldout_tokens_gptq_lower": f"{(eg < er).float().mean():.3f}"})
    base = perplexity(fp, held)

    def swapped(sel) -> tuple[float, float]:
        out = []
        for D in (R, G):
            for n in names:
                fp.get_submodule(n).weight.data = (D if sel(n) else W)[n].clone()
            out.append(perplexity(fp, held) - base)
        return out[0], out[1]

    groups = [("all", lambda n: True)] + [(f"layer {i}", lambda n, i=i: f".layers.{i}." in n)
                                          for i in range(fp.config.num_hidden_layers)]
    groups += [(f"all {k}", lambda n, k=k: n.endswith(k)) for k in KINDS]
    swaps = []
    for label, sel in groups:
        r, g = swapped(sel)
        swaps.append({"replaced": label, "d_ppl_rtn": f"{r:+.4f}", "d_ppl_gptq": f"{g:+.4f}"})
        print(swaps[-1], flush=True)
    md = [f"# Per-Linear GPTQ vs RTN ({a.bits}-bit, group 128): `{a.model}`", "",
          f"Generated by `OMP_NUM_THREADS=1 python bench/quantize_layers.py --bits {a.bits}` on "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Calibration {a.calib_samples} x 512 tokens of "
          "the training split. `calib_*`: tr(dW H dW^T) on each Linear's true-sequential calibration Hessian "
          "(what GPTQ minimises), `calib_ratio` = GPTQ / RTN. `heldout_ratio`: the same mean squared output "
          f"error on the first {a.heldout_tokens} held-out tokens' fp32 inputs; `heldout_tokens_gptq_lower`: "
          "the share of those tokens on which GPTQ's output error is the lower one.", "",
          format_table(rows, list(rows[0])), "",
          "## Held-out perplexity when only some Linears are quantized", "",
          f"fp32 ppl {base:.3f} on {held.numel()} held-out tokens; each row replaces only the named Linears of "
          "the fp32 model by their RTN or GPTQ copies (the others stay fp32).", "",
          format_table(swaps, ["replaced", "d_ppl_rtn", "d_ppl_gptq"]), ""]
    Path(a.results).mkdir(parents=True, exist_ok=True)
    (Path(a.results) / "quantize_layers.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
