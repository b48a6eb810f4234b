"""RTN: round-to-nearest group-wise quantization (no calibration data)."""

from __future__ import annotations

import torch

from compress.layerjob import LayerJob
from compress.quant import QuantArgs, Quantized, qparams, quantize_codes


def rtn(w: torch.Tensor, args: QuantArgs) -> Quantized:
    """Round-to-nearest quantization of a 2-D weight (out, in) in groups of args.group_size columns."""
    out, cols = w.shape
    g = args.group_size
    wg = w.float().reshape(out, cols // g, g)
    scale, zero = qparams(wg, args)
    codes = quantize_codes(wg, scale.unsqueeze(-1), zero.unsqueeze(-1), args.maxq).view(out, cols)
    return Quantized(codes.to(torch.uint8), scale, zero.to(torch.uint8), args.bits, g, args.sym)


def quantize_layer(job: LayerJob) -> dict[str, Quantized]:
    return {name: rtn(mod.weight.data, job.args[name]) for name, mod in job.linears.items()}
