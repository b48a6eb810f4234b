"""Magnitude pruning and Wanda (Sun et al. 2023): remove the weights with the smallest score.

magnitude: score |W|, compared over the whole matrix (unstructured) or within each M-group (N:M).
Wanda: score |W_ij| * ||X_j||_2 (X_j: input channel j over every calibration token), compared within each
output row (unstructured) or each M-group (N:M); no weight update. The Linears of a decoder layer are pruned
true-sequentially (gptq.sequential_groups), so later ones see the activations of the pruned earlier ones.
"""

from __future__ import annotations

import torch

from compress.layerjob import LayerJob
from compress.sparse_store import prune_mask


def sequential_groups(job: LayerJob) -> list[list[str]]:
    """Linears in execution order, grouped when they read the same input tensor (q/k/v, gate/up).

    Like gptq.sequential_groups, but the inputs are kept alive while comparing storage pointers: otherwise a
    freed tensor's address can be reused (o_proj's input and gate/up's), grouping unrelated Linears at random.
    """
    seen: list[tuple[str, torch.Tensor]] = []

    def hook(name: str):
        return lambda x: seen.append((name, x)) if name not in {n for n, _ in seen} else None

    first = LayerJob(job.layer, job.prefix, job.linears, job.args, job.config, job.inputs[:1])
    first.run({n: hook(n) for n in job.linears})
    groups: list[list[str]] = []
    last = None
    for name, x in seen:
        if groups and last is not None and x.data_ptr() == last.data_ptr() and x.shape == last.shape:
            groups[-1].append(name)
        else:
            groups.append([name])
        last = x
    return groups


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
