"""Magnitude pruning and Wanda (Sun et al. 2023): remove the weights with the smallest score.

magnitude: score |W|, compared over the whole matrix (unstructured) or within each M-group (N:M).
Wanda: score |W_ij| * ||X_j||_2 (X_j: input channel j over every calibration token), compared within each
output row (unstructured) or each M-group (N:M); no weight update. The Linears of a decoder layer are pruned
true-sequentially (gptq.sequential_groups), so later ones see the activations of the pruned earlier ones.
"""

from __future__ import annotations

import torch

from compress.gptq import sequential_groups
from compress.layerjob import LayerJob
from compress.sparse_store import prune_mask


class InputNorm:
    """Running sum of squares per input channel."""

    def __init__(self, cols: int) -> None:
        self.sq = torch.zeros(cols, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> None:
        self.sq += x.reshape(-1, x.shape[-1]).double().pow(2).sum(0)

    @property
    def norm(self) -> torch.Tensor:
        return self.sq.sqrt().float()


def magnitude_layer(job: LayerJob) -> dict[str, torch.Tensor]:
    s, nm = job.options["sparsity"], job.options["nm"]
    out = {}
    for n, mod in job.linears.items():
        w = mod.weight.data
        out[n] = w.masked_fill(prune_mask(w.abs(), s, nm, per_row=False), 0)
        mod.weight.data = out[n]
    return out


def wanda_layer(job: LayerJob) -> dict[str, torch.Tensor]:
    s, nm = job.options["sparsity"], job.options["nm"]
    out = {}
    groups = sequential_groups(job)
    seen = {n for g in groups for n in g}
    groups += [[n] for n in job.linears if n not in seen]  # never called: no activations, norm 0 -> magnitude
    for group in groups:
        norms = {n: InputNorm(job.linears[n].in_features) for n in group}
        if group[0] in seen:
            job.run({n: norms[n].add for n in group}, stop_early=True)
        for n in group:
            w = job.linears[n].weight.data
            xn = norms[n].norm if group[0] in seen else torch.ones(w.shape[1])
            out[n] = w.masked_fill(prune_mask(w.abs() * xn, s, nm, per_row=True), 0)
            job.linears[n].weight.data = out[n]
    return out
