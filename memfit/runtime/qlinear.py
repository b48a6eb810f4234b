"""A compress output's Linears, one class per weight format: int4 on torch's CPU pack, int4 on CUDA
(tinygemm), and dequantize-per-call for every other width.

``pick_backend`` chooses by device and shape (4-bit, group 32/64/128/256, out % 16 == 0; CUDA also wants
in_features % 1024 == 0); ``quant_linear`` builds it. tinygemm's int4 convention is
W = (q - 8) * scale + zero, so zero = (8 - z) * scale.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.runtime.embeddings import Int8RowsLinear, int8_rows_of
from memfit.runtime.quantized import Quantized

INT4_GROUPS = (32, 64, 128, 256)


def pick_backend(q: Quantized, device: torch.device) -> str:
    out, cols = q.codes.shape
    ok4 = q.bits == 4 and q.group_size in INT4_GROUPS and out % 16 == 0 and cols % q.group_size == 0
    if ok4 and device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "int4_cpu"
    if ok4 and device.type == "cuda" and cols % 1024 == 0:
        return "int4_cuda"
    return "dequant"


def _int4_scale_zeros(q: Quantized) -> torch.Tensor:
    """tinygemm's (n_groups, out, 2) scale and zero for W = (q - 8) * scale + zero, as fp32."""
    scale = q.scale.float()
    zero = (2 ** (q.bits - 1) - q.zero.float()) * scale
    return torch.stack([scale.t(), zero.t()], dim=-1).contiguous()


class Int4CpuLinear(nn.Module):
    """4-bit weights in torch's CPU int4 pack (aten._weight_int4pack_mm_for_cpu, bf16 activations, fp32 in and
    out of the module). memfit's own kernel reads the same pack (int4.Int4KernelLinear)."""

    FORMAT = "int4_cpu"

    def __init__(self, q: Quantized, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = q.codes.shape
        self.bits, self.group_size, self.backend = q.bits, q.group_size, self.FORMAT
        self.register_buffer("packed", self._pack(q.codes.to(torch.int32), device))
        # the int4 kernels are fast with bf16 activations (CPU fp32/fp16 inputs take a ~50x slower path)
        self.register_buffer("scale_zeros", _int4_scale_zeros(q).to(device=device, dtype=torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=dtype))

    @staticmethod
    def _pack(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8).to(device)

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scale_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(self.scale_zeros.dtype).contiguous()
        y = self._mm(x2).to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, device=self.packed.device, dtype=self.scale_zeros.dtype)
        return self._mm(eye).t().float()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, backend={self.backend}")


class Int4CudaLinear(Int4CpuLinear):
    """4-bit weights in tinygemm's CUDA pack (aten._weight_int4pack_mm, bf16 activations); the CPU format's
    interface with the CUDA kernel and pack (codes as bytes, two per byte)."""

    FORMAT = "int4_cuda"

    @staticmethod
    def _pack(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
        u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)
        return torch.ops.aten._convert_weight_to_int4pack(u8, 8)

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scale_zeros)


class DequantLinear(nn.Module):
    """Any bit width: the codes kept as uint8 and W = (q - z) * s rebuilt on each call (the exact reference)."""

    FORMAT = "dequant"

    def __init__(self, q: Quantized, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = q.codes.shape
        self.bits, self.group_size, self.backend = q.bits, q.group_size, self.FORMAT
        self.register_buffer("codes", q.codes.to(device))
        self.register_buffer("scale", q.scale.float().to(device=device, dtype=dtype))
        self.register_buffer("zero", q.zero.to(device=device, dtype=dtype))
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=dtype))

    def dequantized_weight(self) -> torch.Tensor:
        g = self.group_size
        q = self.codes.view(self.out_features, -1, g).to(self.scale.dtype)
        return ((q - self.zero.unsqueeze(-1)) * self.scale.unsqueeze(-1)).view(self.out_features, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.dequantized_weight().to(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    extra_repr = Int4CpuLinear.extra_repr


QUANT_LINEARS = (Int4CpuLinear, Int4CudaLinear, DequantLinear)  # the formats a compress output loads as
_BY_BACKEND = {c.FORMAT: c for c in QUANT_LINEARS}


def quant_linear(q: Quantized, bias: torch.Tensor | None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, backend: str | None = None) -> nn.Module:
    """A compress output's Linear in the format for ``device`` (``pick_backend``; per-row symmetric 8-bit: int8
    rows, which the int8 panel kernel runs), or the one ``backend`` names."""
    device = torch.device(device)
    rows = int8_rows_of(q) if backend is None else None
    if rows is not None:  # per-row symmetric 8-bit (--quantize-embeddings int8): memfit's int8 rows format
        return Int8RowsLinear(*rows, bias).to(device)
    backend = backend or pick_backend(q, device)
    if backend not in _BY_BACKEND:
        raise ValueError(f"unknown quantized Linear backend {backend!r} ({', '.join(_BY_BACKEND)})")
    return _BY_BACKEND[backend](q, bias, device, dtype)
