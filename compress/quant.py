"""Group-wise integer quantization primitives shared by every method (RTN, GPTQ, AWQ).

A weight W (out, in) is split into groups of `group_size` consecutive input columns. Each (row, group)
gets an fp16 scale s and an integer zero point z; codes q are unsigned `bits`-bit integers and
W ~= (q - z) * s. Symmetric: z = 2**(bits-1) and s = max|w| / ((2**bits - 1) / 2) (the GPTQ and
compressed-tensors convention). Asymmetric: s = (max - min) / (2**bits - 1), z = round(-min / s).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.errors import UserError

SUPPORTED_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class QuantArgs:
    bits: int
    group_size: int
    sym: bool

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1


@dataclass
class Quantized:
    """Result of quantizing one Linear weight: unsigned codes plus per-(row, group) scale and zero."""

    codes: torch.Tensor  # uint8 (out, in)
    scale: torch.Tensor  # float32 (out, n_groups), values exactly representable in fp16
    zero: torch.Tensor  # uint8 (out, n_groups)
    bits: int
    group_size: int
    sym: bool

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.scale, self.zero, self.group_size)


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


def qparams(wg: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero for grouped weights wg (..., group): returns (scale, zero) of shape (...)."""
    wg = wg.float()
    if args.sym:
        amax = wg.abs().amax(-1)
        scale = amax / (args.maxq / 2)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        scale = scale.half().float()
        zero = torch.full_like(scale, 2 ** (args.bits - 1))
    else:
        wmin = wg.amin(-1).clamp(max=0)
        wmax = wg.amax(-1).clamp(min=0)
        scale = (wmax - wmin) / args.maxq
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        scale = scale.half().float().clamp(min=6.2e-5)
        zero = torch.round(-wmin / scale).clamp(0, args.maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Codes for w given broadcastable scale/zero (float)."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    out, cols = codes.shape
    q = codes.float().view(out, cols // group_size, group_size)
    w = (q - zero.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)
    return w.view(out, cols)
