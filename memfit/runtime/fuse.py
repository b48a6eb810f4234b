"""One int4 matmul for several projections of the same input: q/k/v, and the MLP's gate/up.

Why: at decode batch sizes each int4 projection is a small, overhead-bound kernel call plus a bf16
conversion of its input and back, so 7 calls per layer become 4. Measured (A/B in one process, CPU time,
one thread, the serving benchmark's 33.7M Llama as a compress 4-bit output, batch 1): 13.4 vs 14.8 ms
per decode step, and 15.4 vs 17.4 in a second run. fp32 ``nn.Linear`` on MKL's sgemm is not fused: the
same A/B measured it 3% faster at batch 1 but 4-11% slower at batch 4 and 16 (the wider matrix and the
strided splits), so it keeps its separate calls; on oneDNN (memfit.runtime.dense) it is fused at packing time and
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
        parts = [pack(x.contiguous(), 8) for x in torch.split(w, list(rows))]  # 8: as memfit.runtime.qlinear
        return torch.equal(torch.cat(parts), pack(w, 8))
    except RuntimeError:
        return False


class Int4KernelLinear(nn.Module):
    """A compress ``QuantLinear`` (int4_cpu backend) on memfit.runtime.kernels' ``int4_linear``: same packed weight and
    scales, fp32 activations in and out (no bf16 round trip); other input dtypes run the original module."""

    def __init__(self, ql: nn.Module, ops, block: int) -> None:
        super().__init__()
        self.ql, self.ops, self.block = ql, ops, block
        self.in_features, self.out_features = ql.in_features, ql.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return self.ql(x)
        ql = self.ql
        y = self.ops.int4_linear(x, ql.packed, ql.scale_zeros, ql.group_size, self.block)
        return y if ql.bias is None else y + ql.bias.to(y.dtype)


def int4_on_kernels(model: nn.Module, ops) -> int:
    """Swap the model's resident int4_cpu QuantLinears (output size a multiple of the pack's row block) for
    Int4KernelLinear; returns how many. After ``fuse``: the fused ones' packed weights are views by then."""
    from memfit.runtime.kernels import int4_block
    from memfit.runtime.qlinear import QuantLinear

    block = int4_block() if ops is not None else None
    if block is None:
        return 0
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is QuantLinear and child.backend == "int4_cpu" and _resident(child) \
                    and child.out_features % block == 0 and child.packed.is_contiguous():
                setattr(parent, name, Int4KernelLinear(child, ops, block))
                n += 1
    return n


def fuse(mods: list[nn.Module], ops=None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A function computing ``torch.cat([m(x) for m in mods], -1)`` with one kernel call, or None. With
    memfit.runtime.kernels' ``ops``, fused int4 projections run on its ``int4_linear`` (fp32 in and out)."""
    from memfit.runtime.dense import FusedSlice
    from memfit.runtime.qlinear import QuantLinear

    if all(type(m) is FusedSlice for m in mods) and len({id(m.fused) for m in mods}) == 1 \
            and [m.start for m in mods] == [0] + [m.stop for m in mods[:-1]] \
            and mods[-1].stop == mods[0].fused.out_features:
        return mods[0].fused  # memfit.runtime.dense packed them as one weight already
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
        from memfit.runtime.kernels import int4_block

        block = int4_block() if ops is not None else None
        if block is not None and packed.shape[0] % block == 0:

            def int4_kernel(x: torch.Tensor) -> torch.Tensor:
                if x.dtype != torch.float32:
                    return int4(x)
                return ops.int4_linear(x, packed, scale_zeros, group, block)

            # what memfit.runtime.fast_stack hands the C++ layer loop
            int4_kernel.int4 = (packed, scale_zeros, group, block)  # type: ignore[attr-defined]
            # two equal halves (the MLP's gate and up): silu(gate) * up straight from the kernel, as
            # PanelLinear's pairs (slot_model checks the activation is SiLU before using it)
            sizes = [m.out_features for m in mods]
            int4_kernel.pairs = len(sizes) == 2 and sizes[0] == sizes[1] and sizes[0] % block == 0  # type: ignore[attr-defined]

            def silu_mul(x: torch.Tensor) -> torch.Tensor:
                if x.dtype != torch.float32:
                    gu = int4(x)
                    n = gu.shape[-1] // 2
                    return torch.nn.functional.silu(gu[..., :n]) * gu[..., n:]
                return ops.int4_linear(x, packed, scale_zeros, group, block, silu_mul=True)

            int4_kernel.silu_mul = silu_mul  # type: ignore[attr-defined]
            return int4_kernel

        def int4(x: torch.Tensor) -> torch.Tensor:
            x2 = x.reshape(-1, k).to(dtype).contiguous()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group, scale_zeros)
            return y.to(x.dtype).view(*x.shape[:-1], -1)

        return int4
    return None
