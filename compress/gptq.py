"""GPTQ (Frantar et al. 2022): second-order weight quantization from calibration activations.

For each Linear, H = 2/n * sum x x^T over its calibration inputs; columns are quantized one at a time
and the rounding error is spread onto the not-yet-quantized columns through the Cholesky factor of
H^-1 (damped by 1% of mean(diag H)), with lazy batch updates per block of 128 columns. Optional
act-order processes columns by decreasing diag(H) and uses static groups (group parameters taken
from the un-updated weight), so the stored format needs no column permutation.
Modules of a decoder layer are quantized true-sequentially: a group of Linears sharing an input
(q/k/v, gate/up) sees the inputs produced by the already-quantized earlier ones.
"""

from __future__ import annotations

import torch

from compress.layerjob import LayerJob
from compress.quant import QuantArgs, Quantized, qparams, quantize_codes
from compress.rtn import rtn

HESSIAN_BLOCK = 512  # columns per GEMM of Hessian.add; smaller blocks skip more of the lower triangle but
# run narrower, less efficient GEMMs


class Hessian:
    """H = 2/n * sum x x^T over the n input rows seen, accumulated in place.

    x^T x is symmetric, so each batch adds only the column blocks on and above the diagonal (one GEMM per
    block of HESSIAN_BLOCK columns: 5/8 of the full product's work at 2048 columns); `H` mirrors them."""

    def __init__(self, cols: int) -> None:
        self.sum = torch.zeros(cols, cols)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.n += x.shape[0]
        cols = x.shape[1]
        for j0 in range(0, cols, HESSIAN_BLOCK):
            j1 = min(j0 + HESSIAN_BLOCK, cols)
            self.sum[:j1, j0:j1].addmm_(x[:, :j1].t(), x[:, j0:j1])

    @property
    def H(self) -> torch.Tensor:
        return (torch.triu(self.sum) + torch.triu(self.sum, 1).t()) * (2 / max(self.n, 1))


def _hinv_upper(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor of the damped inverse Hessian; more damping if H is not positive definite."""
    diag = torch.arange(H.shape[0])
    damp = percdamp * torch.mean(torch.diag(H))
    for _ in range(6):
        Hd = H.clone()
        Hd[diag, diag] += damp
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                return U
        damp *= 10
    raise RuntimeError("GPTQ: Hessian is not positive definite even with heavy damping")


Prepared = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]  # (Hinv upper factor, column order, dead columns)


def prepare(H: torch.Tensor, percdamp: float = 0.01, act_order: bool = False) -> Prepared:
    """What gptq needs from H alone: the Linears of a group share it, so it is computed once per group."""
    H = H.float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        H = H[perm][:, perm]
    return _hinv_upper(H, percdamp), perm, dead


def gptq(w: torch.Tensor, H: torch.Tensor, args: QuantArgs, blocksize: int = 128, percdamp: float = 0.01,
         act_order: bool = False, prepared: Prepared | None = None) -> Quantized:
    """Quantize weight w (out, in) given the input Hessian H (in, in); `prepared`: prepare(H, percdamp, act_order)
    already computed (then percdamp and act_order are its)."""
    Hinv, perm, dead = prepared if prepared is not None else prepare(H, percdamp, act_order)
    W = w.detach().float().clone()
    out, cols = W.shape
    g = args.group_size
    ng = cols // g
    W[:, dead] = 0
    scale = torch.zeros(out, ng)
    zero = torch.zeros(out, ng)
    if perm is not None:  # static groups: parameters from the original weight, before any error feedback
        scale, zero = qparams(W.view(out, ng, g), args)
        W = W[:, perm]
    blocksize = max(blocksize // g, 1) * g if g <= blocksize else g
    group_of = (perm // g).tolist() if perm is not None else None  # act-order: each column's (static) group
    Q = torch.zeros_like(W)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if group_of is not None:
                gi = group_of[col]
            else:
                gi = col // g
                if col % g == 0:  # groups never straddle blocks (blocksize is a multiple of g)
                    s, z = qparams(W1[:, i : i + g].unsqueeze(1), args)
                    scale[:, gi], zero[:, gi] = s[:, 0], z[:, 0]
            s, z = scale[:, gi], zero[:, gi]
            wcol = W1[:, i]
            q = quantize_codes(wcol, s, z, args.maxq)
            Q1[:, i] = q
            err = (wcol - (q - z) * s) / Hinv1[i, i]
            W1[:, i:].addr_(err, Hinv1[i, i:], alpha=-1)  # the rank-1 error update, in place
            Err1[:, i] = err
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return Quantized(Q.to(torch.uint8), scale.float(), zero.to(torch.uint8), args.bits, g, args.sym)


def sequential_groups(job: LayerJob) -> list[list[str]]:
    """Linears in execution order, grouped when they read the same input tensor (q/k/v, gate/up)."""
    # Keep each input alive until the grouping is done: comparing addresses of freed tensors would let
    # the allocator's reuse of a buffer group Linears that read different inputs.
    seen: list[tuple[str, torch.Tensor]] = []

    def hook(name: str):
        return lambda x: seen.append((name, x)) if name not in {n for n, _ in seen} else None

    first = LayerJob(job.layer, job.prefix, job.linears, job.args, job.config, job.inputs[:1])
    first.run({n: hook(n) for n in job.linears})
    groups: list[list[str]] = []
    last_ptr = None
    for name, x in seen:
        ptr = (x.data_ptr(), x.shape)
        if groups and ptr == last_ptr:
            groups[-1].append(name)
        else:
            groups.append([name])
        last_ptr = ptr
    return groups


def quantize_layer(job: LayerJob) -> dict[str, Quantized]:
    results: dict[str, Quantized] = {}
    act_order = bool(job.options.get("act_order", False))
    groups = sequential_groups(job)
    seen = {n for grp in groups for n in grp}
    for n in job.linears:  # a Linear the layer never calls gets no Hessian: plain RTN
        if n not in seen:
            results[n] = rtn(job.linears[n].weight.data, job.args[n])
    for group in groups:  # the Linears of a group read one input tensor: one Hessian serves them all
        h = Hessian(job.linears[group[0]].in_features)
        job.run({group[0]: h.add}, stop_early=True)
        H = h.H
        prepared = prepare(H, act_order=act_order)
        for n in group:
            mod = job.linears[n]
            results[n] = gptq(mod.weight.data, H, job.args[n], prepared=prepared)
            mod.weight.data = results[n].dequantize().to(mod.weight.dtype)
        job.done(group)  # later passes replay the children that can no longer change
    return results
