"""memfit compress: quantization (RTN, GPTQ, AWQ, bitsandbytes NF4/int8), pruning and low-rank factorization
into compressed-tensors dirs.

Layout: methods.py (the registry: kind, calibration, layer function per method) -> walk.py (the one layer
walk) <- quantize.py / prune.py (drivers) <- recipe.py (typed `compress pipeline` recipes) <- cli.py.
`compress.load(path, device="cpu")` returns a ready-to-run model for any memfit output or plain HF dir.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn


def load(path: str | Path, device: str = "cpu") -> nn.Module:
    """Load a quantized (or plain Hugging Face) model dir onto device, with fast quantized Linears."""
    from compress.loader import load as _load

    return _load(path, device=device)


__all__ = ["load"]
