"""Quantized Linear for inference: int4 kernels where available, dequantize-on-the-fly otherwise.

Backends: "int4_cpu" (aten._weight_int4pack_mm_for_cpu with bf16 activations, fp32 in and out of the module;
4-bit, group 32/64/128/256, out % 16 == 0),
"int4_cuda" (aten._weight_int4pack_mm, bf16 activations; written to the torch API but not tested
here: no GPU), "dequant" (any width: codes kept as uint8, W = (q - z) * s rebuilt each call).
tinygemm's int4 convention is W = (q - 8) * scale + zero, so zero = (8 - z) * scale.
"""

from __future__ import annotations

import torch
from torch import nn

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


class QuantLinear(nn.Module):
    """A compress output's Linear: packed for the device's int4 kernel at load, or dequantized per call."""

    FORMAT = "quant"

    def __init__(self, q: Quantized, bias: torch.Tensor | None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, backend: str | None = None) -> None:
        super().__init__()
        device = torch.device(device)
        self.out_features, self.in_features = q.codes.shape
        self.bits, self.group_size = q.bits, q.group_size
        self.backend = backend or pick_backend(q, device)
        # the int4 kernels are fast with bf16 activations (CPU fp32/fp16 inputs take a ~50x slower path)
        self.dtype = torch.bfloat16 if self.backend in ("int4_cpu", "int4_cuda") else dtype
        scale = q.scale.float()
        if self.backend in ("int4_cpu", "int4_cuda"):
            zero = (2 ** (q.bits - 1) - q.zero.float()) * scale
            sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()  # (n_groups, out, 2)
            codes = q.codes.to(torch.int32)
            if self.backend == "int4_cpu":
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8)
            else:
                u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)
                packed = torch.ops.aten._convert_weight_to_int4pack(u8, 8)
            self.register_buffer("packed", packed.to(device))
            self.register_buffer("scale_zeros", sz.to(device=device, dtype=self.dtype))
        else:
            self.register_buffer("codes", q.codes.to(device))
            self.register_buffer("scale", scale.to(device=device, dtype=dtype))
            self.register_buffer("zero", q.zero.to(device=device, dtype=dtype))
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=dtype))

    @property
    def format(self) -> str:
        return self.backend  # int4_cpu | int4_cuda | dequant

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, backend={self.backend}")

    def dequantized_weight(self) -> torch.Tensor:
        if self.backend != "dequant":
            eye = torch.eye(self.in_features, device=self.packed.device, dtype=self.scale_zeros.dtype)
            return self._int4(eye).t().float()
        g = self.group_size
        q = self.codes.view(self.out_features, -1, g).to(self.scale.dtype)
        return ((q - self.zero.unsqueeze(-1)) * self.scale.unsqueeze(-1)).view(self.out_features, -1)

    def _int4(self, x2: torch.Tensor) -> torch.Tensor:
        if self.backend == "int4_cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scale_zeros)
        return torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scale_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.backend == "dequant":
            y = torch.nn.functional.linear(x, self.dequantized_weight().to(x.dtype))
        else:
            x2 = x.reshape(-1, self.in_features).to(self.scale_zeros.dtype).contiguous()
            y = self._int4(x2).to(x.dtype).view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)
