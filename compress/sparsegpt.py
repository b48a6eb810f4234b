"""SparseGPT (Frantar & Alistarh 2023): pruning with OBS weight updates, on gptq.py's Hessian machinery.

Columns are visited left to right in blocks of 128 through the upper Cholesky factor of the damped H^-1
(gptq._hinv_upper). The mask is chosen by w^2 / [H^-1]_jj^2, per block (unstructured: the lowest
`sparsity` fraction of the block) or per M-group of columns when the first column of the group is
reached (N:M); each pruned (and, with quantization, each rounded) weight's error is spread onto the
columns not yet visited. With a QuantArgs it prunes and quantizes jointly (the paper's 2:4 + 4-bit);
with a fixed mask it is GPTQ that keeps an existing sparsity pattern: `sparse-gptq`, used by
`compress pipeline` for a quantize step after a prune step (plain GPTQ would fill the zeros back in).
"""

from __future__ import annotations

import torch

from compress.gptq import Hessian, _hinv_upper, sequential_groups
from compress.layerjob import LayerJob
from compress.quant import QuantArgs, Quantized, qparams, quantize_codes
from compress.rtn import rtn
from compress.wanda import magnitude_layer


def sparsegpt(w: torch.Tensor, H: torch.Tensor, sparsity: float = 0.0, nm: tuple[int, int] | None = None,
              quant: QuantArgs | None = None, fixed_mask: torch.Tensor | None = None, blocksize: int = 128,
              percdamp: float = 0.01) -> tuple[torch.Tensor, Quantized | None]:
    """Prune (and optionally quantize) w (out, in) given input Hessian H; returns the new weight (zeros pruned)."""
    W = w.detach().float().clone()
    H = H.float().clone()
    out, cols = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    Hinv = _hinv_upper(H, percdamp)
    g = quant.group_size if quant else 1
    if nm is not None:  # M-groups never straddle blocks
        blocksize = max(blocksize // nm[1], 1) * nm[1]
    if quant:
        blocksize = max(blocksize // g, 1) * g if g <= blocksize else g
        scale, zero = torch.zeros(out, cols // g), torch.zeros(out, cols // g)
        codes = torch.zeros(out, cols)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        d = torch.diag(Hinv1)
        if fixed_mask is not None:
            mask1 = fixed_mask[:, i1:i2].clone()
        elif nm is None:
            mask1 = torch.zeros_like(W1, dtype=torch.bool)
            k = int(W1.numel() * sparsity)
            if k:
                score = (W1.pow(2) / d.pow(2).unsqueeze(0)).flatten()
                mask1.view(-1).scatter_(0, torch.topk(score, k, largest=False).indices, True)
        else:
            mask1 = torch.zeros_like(W1, dtype=torch.bool)
        for i in range(i2 - i1):
            col = i1 + i
            if nm is not None and fixed_mask is None and i % nm[1] == 0:
                n, m = nm
                score = W1[:, i : i + m].pow(2) / d[i : i + m].pow(2).unsqueeze(0)
                mask1.scatter_(1, i + torch.topk(score, m - n, dim=1, largest=False).indices, True)
            wcol = W1[:, i]
            q = wcol.masked_fill(mask1[:, i], 0)
            if quant:
                if col % g == 0:  # groups never straddle blocks (blocksize is a multiple of g)
                    s, z = qparams(W1[:, i : i + g].masked_fill(mask1[:, i : i + g], 0).unsqueeze(1), quant)
                    scale[:, col // g], zero[:, col // g] = s[:, 0], z[:, 0]
                s, z = scale[:, col // g], zero[:, col // g]
                c = quantize_codes(q, s, z, quant.maxq)
                c = torch.where(mask1[:, i], z, c)  # a pruned weight is the zero point: exactly 0
                codes[:, col] = c
                q = (c - z) * s
            Q1[:, i] = q
            err = (wcol - q) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    qz = None
    if quant:
        qz = Quantized(codes.to(torch.uint8), scale, zero.to(torch.uint8), quant.bits, g, quant.sym)
    return W, qz


def _hessians(job: LayerJob, group: list[str]) -> dict[str, Hessian]:
    """One Hessian for the group's Linears: they read the same input tensor (gptq.sequential_groups)."""
    h = Hessian(job.linears[group[0]].in_features)
    job.run({group[0]: h.add}, stop_early=True)
    return dict.fromkeys(group, h)


def prune_layer(job: LayerJob) -> dict[str, torch.Tensor]:
    s, nm = job.options["sparsity"], job.options["nm"]
    out = {}
    for group in sequential_groups(job):
        hs = _hessians(job, group)
        for n in group:
            mod = job.linears[n]
            out[n], _ = sparsegpt(mod.weight.data, hs[n].H, s, nm)
            mod.weight.data = out[n]
        job.done(group)
    for n, mod in job.linears.items():  # never called by the layer: no Hessian, magnitude
        if n not in out:
            out.update(magnitude_layer(LayerJob(job.layer, job.prefix, {n: mod}, {}, job.config, [], job.options)))
    return out


def quantize_layer(job: LayerJob) -> dict[str, Quantized]:
    """The `sparse-gptq` quantization method: GPTQ that keeps each weight's zeros (its pruning mask) exact."""
    results: dict[str, Quantized] = {}
    for group in sequential_groups(job):
        hs = _hessians(job, group)
        for n in group:
            mod = job.linears[n]
            _, results[n] = sparsegpt(mod.weight.data, hs[n].H, quant=job.args[n], fixed_mask=mod.weight.data == 0)
            mod.weight.data = results[n].dequantize()
        job.done(group)
    for n, mod in job.linears.items():
        if n not in results:
            results[n] = rtn(mod.weight.data, job.args[n])  # RTN maps 0 to the zero point: zeros stay exact
    return results
