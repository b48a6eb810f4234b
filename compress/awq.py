"""AWQ (Lin et al. 2023): activation-aware per-channel scaling plus weight clipping, then RTN.

For each group of Linears reading one input (q/k/v, o, gate/up, down in a Llama layer) whose producing op can
absorb a per-channel scale (awqfold.py finds and verifies it from the layer's structure: the input norm, the
value rows -> output projection, the up half of a gated MLP -> down), the input channels are scaled by
s = s_x**alpha, where s_x is the mean |activation| per channel; alpha is searched on a 20-point grid in
[0, 1) to minimise the error of the quantized Linears' outputs on calibration tokens. The scale is folded into
the previous op, so the float model is unchanged. With grouped-query attention each value channel feeds
several output-projection columns; they share one scale (an extension of AWQ, which skips v->o when the
shapes differ). Groups with no exact fold (gpt_neox's MLP down projection reads gelu(h)) are not scaled; the
output's record lists them. Then, for every Linear but q/k (and the q/k rows of a fused q/k/v projection),
the per-group clipping range is shrunk (down to 0.5x) where that lowers the output error. alpha = 0 and
ratio 1 are plain RTN, so the search never does worse than RTN on the calibration proxy.
"""

from __future__ import annotations

import torch

from compress import awqfold
from compress.layerjob import LayerJob
from compress.quant import QuantArgs, Quantized
from compress.rtn import rtn

GRID = 20
SAMPLE_TOKENS = 4096  # tokens kept per Linear input for the scale search
CLIP_TOKENS = 512


def fake_quant(w: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    return rtn(w, args).dequantize()


class InputStats:
    """Mean |x| per channel over all tokens plus a random sample of tokens."""

    def __init__(self, keep_per_batch: int, seed: int) -> None:
        self.abs_sum: torch.Tensor | None = None
        self.n = 0
        self.samples: list[torch.Tensor] = []
        self.keep = keep_per_batch
        self.gen = torch.Generator().manual_seed(seed)

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        s = x.abs().sum(0)
        self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        self.n += x.shape[0]
        idx = torch.randperm(x.shape[0], generator=self.gen)[: self.keep]
        self.samples.append(x[idx])

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / self.n

    @property
    def x(self) -> torch.Tensor:
        return torch.cat(self.samples)


def search_scale(x: torch.Tensor, x_mean: torch.Tensor, weights: list[torch.Tensor], args: list[QuantArgs],
                 expand: torch.Tensor | None = None) -> torch.Tensor:
    """Best s (one per scaled channel) for Linears reading x; expand maps input columns to scale index."""
    with torch.no_grad():
        ref = torch.cat([x @ w.t() for w in weights], dim=-1)
        best, best_s = float("inf"), torch.ones_like(x_mean)
        for i in range(GRID):
            alpha = i / GRID
            s = x_mean.clamp(min=1e-4).pow(alpha)
            s = s / (s.max() * s.min()).sqrt()
            sf = s if expand is None else s[expand]
            out = torch.cat([x @ (fake_quant(w * sf, a) / sf).t() for w, a in zip(weights, args, strict=True)], -1)
            err = (out - ref).pow(2).mean().item()
            if err < best:
                best, best_s = err, s
        return best_s


def search_clip(w: torch.Tensor, x: torch.Tensor, args: QuantArgs, max_shrink: float = 0.5) -> torch.Tensor:
    """w with each (row, group) clipped to the range that minimises that group's output error."""
    out, cols = w.shape
    g = args.group_size
    x = x[:CLIP_TOKENS].view(-1, cols // g, g)  # (t, ng, g)
    result = []
    for r0 in range(0, out, 256):
        wg = w[r0 : r0 + 256].view(-1, cols // g, g)
        ref = torch.einsum("ong,tng->ont", wg, x)
        amax = wg.abs().amax(-1, keepdim=True)
        best_err = torch.full(wg.shape[:2], float("inf"))
        best_max = amax.clone()
        for i in range(int(max_shrink * GRID)):
            cur_max = amax * (1 - i / GRID)
            wq = fake_quant(torch.clamp(wg, -cur_max, cur_max).view(-1, cols), args).view_as(wg)
            err = (torch.einsum("ong,tng->ont", wq, x) - ref).pow(2).mean(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better.unsqueeze(-1), cur_max, best_max)
        result.append(torch.clamp(wg, -best_max, best_max).view(-1, cols))
    return torch.cat(result)


def scale_layer(job: LayerJob) -> tuple[list[awqfold.Fold], dict[str, torch.Tensor]]:
    """AWQ's scaling step: search s per foldable group and fold it in (the float layer is unchanged).

    Returns the layer's groups (awqfold.plan) and each Linear's calibration input sample as it now reads it
    (x / s), for the clipping search. job.options["awq_record"] (a dict of sets, when given) collects the
    folds made and the groups left unscaled, named relative to the layer, for the output's record."""
    layer = job.layer
    names = set(job.linears)
    folds = awqfold.plan(job)
    record = job.options.get("awq_record")
    if record is not None:
        for f in folds:
            if any(c in names for c in f.consumers):
                record.setdefault("folded" if f.kind else "not_scaled", set()).add(f.describe() if f.kind
                                                                                  else str(f.note))
    keep = max(SAMPLE_TOKENS // max(len(job.inputs), 1), 1)
    stats = {f.tap: InputStats(keep, seed=i) for i, f in enumerate(folds)}
    job.run({t: stats[t].add for t in stats})
    mod = layer.get_submodule
    x_in: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for f in folds:
            quantized = [c for c in f.consumers if c in names]
            x = stats[f.tap].x
            for c in f.consumers:
                x_in[c] = x
            if not quantized or f.kind is None:
                continue
            mean = stats[f.tap].mean_abs
            if f.expand is not None:  # one scale per value channel: average the output columns it feeds
                mean = torch.zeros(f.n_scale).index_add_(0, f.expand, mean) / (len(f.expand) // f.n_scale)
            s = search_scale(x, mean, [mod(c).weight.float() for c in quantized], [job.args[c] for c in quantized],
                             f.expand)
            sf = awqfold.apply(layer, f, s)  # every reader of prev's output gets *s (exact in float)
            for c in f.consumers:
                x_in[c] = x / sf
    return folds, x_in


def quantize_layer(job: LayerJob) -> dict[str, Quantized]:
    """scale_layer, then per Linear the clipping search (awqfold.clip_rows says which rows) and RTN."""
    folds, x_in = scale_layer(job)
    results = {}
    with torch.no_grad():
        for n, lin in job.linears.items():
            w = lin.weight.data.float()
            rows = awqfold.clip_rows(n, folds)
            if n in x_in and rows is None:
                w = search_clip(w, x_in[n], job.args[n])
            elif n in x_in and rows.numel():
                w = w.clone()
                w[rows] = search_clip(w[rows], x_in[n], job.args[n])
            results[n] = rtn(w, job.args[n])
            lin.weight.data = results[n].dequantize().to(lin.weight.dtype)
    return results
