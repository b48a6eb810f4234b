"""Sparse weights on disk in the compressed-tensors `sparse-bitmask` layout, and N:M / unstructured masks.

Per pruned Linear `name`: `name.weight.shape` int64 [out, in], `name.weight.compressed` fp16 (the nonzero
values, row-major), `name.weight.bitmask` uint8 (out, ceil(in/8)), one bit per weight, little bit order, and
`name.weight.row_offsets` int64 (index of each row's first value in `compressed`). A 50%-sparse fp16 weight
takes 0.5 * 2 + 1/8 = 1.125 bytes per weight instead of 2 (0.5625x).
"""

from __future__ import annotations

import torch

from memfit.errors import UserError

SUFFIXES = ("shape", "compressed", "bitmask", "row_offsets")


def parse_pattern(pattern: str, flag: str = "--pattern") -> tuple[int, int] | None:
    """'unstructured' -> None, 'N:M' -> (N, M): keep N of every M consecutive input weights."""
    if pattern == "unstructured":
        return None
    try:
        n, m = (int(v) for v in pattern.split(":"))
    except ValueError:
        raise UserError(f"{flag} must be 'unstructured' or N:M like 2:4, got {pattern!r}") from None
    if not 0 < n < m:
        raise UserError(f"{flag} {pattern}: need 0 < N < M")
    return n, m


def prune_mask(score: torch.Tensor, sparsity: float, nm: tuple[int, int] | None, per_row: bool) -> torch.Tensor:
    """Boolean mask of the weights to REMOVE: the lowest scores, per row / whole matrix, or per M-group for N:M."""
    out, cols = score.shape
    mask = torch.zeros_like(score, dtype=torch.bool)
    if nm is not None:
        n, m = nm
        g = score.reshape(out, cols // m, m)
        idx = torch.topk(g, m - n, dim=-1, largest=False).indices
        return mask.view(out, cols // m, m).scatter_(-1, idx, True).view(out, cols)
    if per_row:
        k = int(cols * sparsity)
        idx = torch.topk(score, k, dim=1, largest=False).indices
        return mask.scatter_(1, idx, True)
    k = int(score.numel() * sparsity)
    idx = torch.topk(score.flatten(), k, largest=False).indices
    return mask.view(-1).scatter_(0, idx, True).view(out, cols)


def tensors_for(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Bitmask-compress weight w (out, in) of module name; zeros are the pruned weights."""
    # imported here: only sparse outputs need compressed-tensors, and compress.load/quantize import this module
    from compressed_tensors.utils.helpers import pack_bitmasks

    w = w.detach().to(torch.float16).cpu().contiguous()
    keep = w != 0
    counts = keep.sum(1)
    return {
        f"{name}.weight.shape": torch.tensor(list(w.shape), dtype=torch.int64),
        f"{name}.weight.compressed": w[keep].contiguous(),
        f"{name}.weight.bitmask": pack_bitmasks(keep.to(torch.uint8)).contiguous(),
        f"{name}.weight.row_offsets": (torch.cumsum(counts, 0) - counts).to(torch.int64),
    }


def has_sparse(src, name: str) -> bool:
    return f"{name}.weight.bitmask" in src


def read_sparse(get, name: str) -> torch.Tensor:
    """Dense fp32 weight of module name; get(key) returns a stored tensor."""
    shape = [int(v) for v in get(f"{name}.weight.shape").tolist()]
    if len(shape) != 2:
        raise UserError(f"{name}.weight.shape: expected 2 dims, got {shape}")
    values = get(f"{name}.weight.compressed")
    bits = get(f"{name}.weight.bitmask")
    if tuple(bits.shape) != (shape[0], (shape[1] + 7) // 8):
        raise UserError(f"{name}.weight.bitmask: shape {tuple(bits.shape)} does not fit weight shape {shape}")
    from compressed_tensors.utils.helpers import unpack_bitmasks  # see tensors_for

    keep = unpack_bitmasks(bits, shape)
    if int(keep.sum()) != values.numel():
        raise UserError(f"{name}.weight.compressed: {values.numel()} values, the bitmask has {int(keep.sum())}")
    w = torch.zeros(shape, dtype=torch.float32)
    w[keep] = values.float()
    return w
