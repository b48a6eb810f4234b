"""A group-quantized Linear weight as compress writes it and the runtime loads it: the hand-over format.

W ~= (q - z) * s per (row, group of ``group_size`` input columns); codes q are unsigned ``bits``-bit integers.
Here, not in compress, because the runtime's Linear formats are built from it and the runtime imports no stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    out, cols = codes.shape
    q = codes.float().view(out, cols // group_size, group_size)
    w = (q - zero.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)
    return w.view(out, cols)


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
