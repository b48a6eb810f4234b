"""One int4 matmul for several projections of the same input: q/k/v, and the MLP's gate/up.

Why: at decode batch sizes each int4 projection is a small, overhead-bound kernel call plus a bf16
conversion of its input and back, so 7 calls per layer become 4. Measured (A/B in one process, CPU time,
one thread, the serving benchmark's 33.7M Llama as a compress 4-bit output, batch 1): 13.4 vs 14.8 ms
per decode step, and 15.4 vs 17.4 in a second run. fp32 ``nn.Linear`` on MKL's sgemm is not fused: the
same A/B measured it 3% faster at batch 1 but 4-11% slower at batch 4 and 16 (the wider matrix and the
strided splits), so it keeps its separate calls; on oneDNN (serve.dense) it is fused at packing time and
only handed over here. The originals' packed weights become slices
of the fused tensor, so memory is not doubled. Only applied to resident modules (no offload hooks, no
tensor-parallel shards) with the same input size, group size and dtype, and only where the CPU's int4
layout keeps the row splits intact (probed once per shape: a split inside a row block would scramble rows).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn


def _resident(m: nn.Module) -> bool:
    if getattr(m, "_hf_hook", None) is not None:
        return False
    return all(not t.is_meta and type(t) in (torch.Tensor, nn.Parameter)
               for t in m.state_dict().values() if isinstance(t, torch.Tensor))


@functools.cache
def _pack_concatenates(rows: tuple[int, ...]) -> bool:
    """Whether packing matrices of these row counts one by one and concatenating the packs gives the pack of
    the stacked matrix. The CPU int4 layout interleaves rows in blocks whose size depends on the CPU's vector
    width (64 rows on an AVX-512 host), so a split inside a block would scramble rows: probed, not assumed."""
    k = 256
    w = torch.randint(0, 16, (sum(rows), k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    try:
        parts = [pack(x.contiguous(), 8) for x in torch.split(w, list(rows))]  # 8: as compress.qlinear
        return torch.equal(torch.cat(parts), pack(w, 8))
    except RuntimeError:
        return False


def fuse(mods: list[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A function computing ``torch.cat([m(x) for m in mods], -1)`` with one kernel call, or None."""
    from compress.qlinear import QuantLinear
    from serve.dense import FusedSlice

    if all(type(m) is FusedSlice for m in mods) and len({id(m.fused) for m in mods}) == 1 \
            and [m.start for m in mods] == [0] + [m.stop for m in mods[:-1]] \
            and mods[-1].stop == mods[0].fused.out_features:
        return mods[0].fused  # serve.dense packed them as one weight already
    if not all(_resident(m) for m in mods):
        return None

    if all(type(m) is QuantLinear and m.backend == "int4_cpu" and m.bias is None for m in mods):
        if len({(m.in_features, m.group_size, m.scale_zeros.dtype) for m in mods}) != 1:
            return None
        if not _pack_concatenates(tuple(m.out_features for m in mods)):
            return None
        packed = torch.cat([m.packed for m in mods])
        scale_zeros = torch.cat([m.scale_zeros for m in mods], dim=1).contiguous()
        off = 0
        for m in mods:
            m.packed = packed[off:off + m.out_features]
            off += m.out_features
        k, group, dtype = mods[0].in_features, mods[0].group_size, scale_zeros.dtype

        def int4(x: torch.Tensor) -> torch.Tensor:
            x2 = x.reshape(-1, k).to(dtype).contiguous()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group, scale_zeros)
            return y.to(x.dtype).view(*x.shape[:-1], -1)

        return int4
    return None
