"""Mixed precision: which dtype to autocast to, and whether fp16 needs a dynamic loss scaler."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class Precision:
    name: str
    """Resolved precision: fp32, bf16 or fp16."""
    device_type: str
    """cpu or cuda."""

    @property
    def dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    def autocast(self) -> contextlib.AbstractContextManager:
        # Weights stay fp32 (master copy); autocast runs matmuls in the low dtype.
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scaler(self) -> torch.amp.GradScaler | None:
        # fp16's 5-bit exponent underflows small gradients: scale the loss up, back off on inf/nan.
        return torch.amp.GradScaler(self.device_type) if self.name == "fp16" else None


def resolve(requested: str, device: torch.device) -> Precision:
    """auto: bf16 on CUDA with bf16, fp16+scaler on older CUDA, fp32 on CPU (bf16 is ~6x slower there)."""
    name = requested
    if requested == "auto":
        if device.type == "cuda":
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            name = "fp32"
    return Precision(name, device.type)
