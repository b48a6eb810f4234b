"""Group-wise integer quantization primitives shared by every method (RTN, GPTQ, AWQ).

A weight W (out, in) is split into groups of `group_size` consecutive input columns. Each (row, group)
gets an fp16 scale s and an integer zero point z; codes q are unsigned `bits`-bit integers and
W ~= (q - z) * s. Symmetric: z = 2**(bits-1) and s = max|w| / ((2**bits - 1) / 2) (the GPTQ and
compressed-tensors convention). Asymmetric: s = (max - min) / (2**bits - 1), z = round(-min / s).
With mse (GPTQ's / GPTQModel's `mse` option), the range is shrunk per (row, group) to p * [min, max], p on a
grid 1, 0.99, ..., 0.21, choosing the p with the least sum |w - dequant(w)|**2.4: clipping a few outliers buys
a finer step for the rest. The search runs in memfit's C++ kernel (memfit/runtime/csrc/quant_search.cpp, 6-15x
the torch loop) where the kernels are built, else in torch ops (`mse_search`: same candidates; a near-tie may
resolve the other way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.defaults import TABLE_GROUP_SIZE
from memfit.errors import UserError
from memfit.runtime import kernels
from memfit.runtime.quantized import Quantized, dequantize  # noqa: F401 - the format compress writes

SUPPORTED_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class QuantArgs:
    bits: int
    group_size: int
    sym: bool
    mse: bool = False  # search a clipping range per group (quantize time only; the stored format is the same)

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1


def resolve_group_size(name: str, in_features: int, group_size: int, fallback: bool) -> tuple[int, str | None]:
    """The group size to use for a layer, plus a note when it differs from the requested one."""
    if in_features % group_size == 0:
        return group_size, None
    msg = f"{name}: group size {group_size} does not divide in_features {in_features}"
    if not fallback:
        raise UserError(msg + " (drop --no-group-fallback to use the largest group size that divides it)")
    for step in (32, 8, 1):
        divisors = [d for d in range(step, min(group_size, in_features) + 1, step) if in_features % d == 0]
        if divisors:
            g = max(divisors)
            return g, msg + f"; using group size {g} for this layer"
    raise AssertionError("unreachable: 1 divides everything")


def vocab_args(kind: str, cols: int) -> QuantArgs:
    """--quantize-embeddings: int8 = one symmetric scale per row (serve's int8 rows, on the int8 panel kernel);
    int4 = asymmetric groups of TABLE_GROUP_SIZE (the largest divisor where it does not divide): a vocabulary
    table loses far more at 4 bits than a decoder Linear (memfit/defaults.py has the measurements)."""
    if kind == "int8":
        return QuantArgs(8, cols, True)
    if kind != "int4":
        raise UserError(f"--quantize-embeddings must be int8 or int4, got {kind!r}")
    return QuantArgs(4, resolve_group_size("embeddings", cols, TABLE_GROUP_SIZE, True)[0], False)


MSE_GRID, MSE_MAXSHRINK, MSE_NORM = 100, 0.8, 2.4  # GPTQ's defaults for its mse search


def _range_params(wmin: torch.Tensor, wmax: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero for the range [wmin, wmax] (wmin <= 0 <= wmax)."""
    if args.sym:
        scale = torch.maximum(-wmin, wmax) / (args.maxq / 2)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        scale = scale.half().float()
        zero = torch.full_like(scale, 2 ** (args.bits - 1))
    else:
        scale = (wmax - wmin) / args.maxq
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        scale = scale.half().float().clamp(min=6.2e-5)
        zero = torch.round(-wmin / scale).clamp(0, args.maxq)
    return scale, zero


def qparams(wg: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero for grouped weights wg (..., group): returns (scale, zero) of shape (...)."""
    wg = wg.float()
    if not args.mse:
        return _range_params(wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0), args)
    ops = kernels.built()
    if ops is not None and wg.device.type == "cpu":
        flat = wg.reshape(-1, wg.shape[-1])
        s, z = ops.mse_qparams(flat, args.bits, args.sym, int(MSE_MAXSHRINK * MSE_GRID), MSE_GRID, MSE_NORM)
        return s.view(wg.shape[:-1]), z.view(wg.shape[:-1])
    return mse_search(wg, args)


def mse_search(wg: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipping search in torch ops (the kernel's reference, and where the kernels cannot be built)."""
    wmin, wmax = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    scale, zero = _range_params(wmin, wmax, args)
    best = torch.full_like(scale, float("inf"))
    for i in range(int(MSE_MAXSHRINK * MSE_GRID)):
        p = 1 - i / MSE_GRID
        s1, z1 = _range_params(p * wmin, p * wmax, args)
        q = quantize_codes(wg, s1.unsqueeze(-1), z1.unsqueeze(-1), args.maxq)
        err = ((q - z1.unsqueeze(-1)) * s1.unsqueeze(-1) - wg).abs().pow(MSE_NORM).sum(-1)
        better = err < best
        best = torch.where(better, err, best)
        scale, zero = torch.where(better, s1, scale), torch.where(better, z1, zero)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Codes for w given broadcastable scale/zero (float)."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)
