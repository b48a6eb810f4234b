"""4-bit Linears on torch's CPU int4 pack: a compress output's projections on memfit's ``int4_linear`` kernel,
and several projections of one input (q/k/v, the MLP's gate/up) fused into one int4 matmul.

Why fused: at decode batch sizes each int4 projection is a small, overhead-bound kernel call, so 7 calls per
layer become 4 (A/B in one process on the serving benchmark's 33.7M Llama as a compress 4-bit output,
batch 1: 13.4 vs 14.8 ms per decode step). The originals' packed weights become slices of the fused tensor,
so memory is not doubled. Only resident modules (no offload hooks, no tensor-parallel shards) with the same
input size, group size and dtype are fused, and only where the CPU's int4 layout keeps the row splits intact
(probed once per shape: a split inside a row block would scramble rows).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from memfit.runtime.kernels import int4_block
from memfit.runtime.linear import ACTS, INT4, NONE, PAIR_KINDS, StackSpec, is_resident, weight_format


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


def _aten_int4(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """aten's CPU int4 matmul (bf16 activations, as torch's kernel wants them), in and out in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).to(scale_zeros.dtype).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group, scale_zeros)
    return y.to(x.dtype).view(*x.shape[:-1], -1)


class Int4KernelLinear(nn.Module):
    """A compress ``Int4CpuLinear`` (qlinear.py) on memfit's ``int4_linear``: same packed weight and scales,
    fp32 activations in and out (no bf16 round trip); other input dtypes run the original module."""

    FORMAT = "int4_kernel"

    def __init__(self, ql: nn.Module, ops, block: int) -> None:
        super().__init__()
        self.ql, self.ops, self.block = ql, ops, block
        self.in_features, self.out_features = ql.in_features, ql.out_features
        self.bf16_dot = False  # prefill rows in bf16 on vdpbf16ps (the engine's bf16 mode sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return self.ql(x)
        ql = self.ql
        y = self.ops.int4_linear(x, ql.packed, ql.scale_zeros, ql.group_size, self.block, bf16_dot=self.bf16_dot)
        return y if ql.bias is None else y + ql.bias.to(y.dtype)

    def stack_spec(self, gate_up: bool, act: str = "silu") -> StackSpec | None:
        if gate_up:
            return None
        ql = self.ql
        return StackSpec(INT4, ql.packed, ql.scale_zeros, NONE if ql.bias is None else ql.bias.detach().float(),
                         ql.group_size, self.block)


class FusedInt4Linear(nn.Module):
    """Several bias-free int4 projections of one input as one int4 matmul over their concatenated packs:
    memfit's kernel for fp32 inputs when built (``ops``), aten's otherwise.

    ``pairs``: two equal halves (the MLP's gate and up) whose ``act(gate) * up`` the kernel computes in its
    epilogue (``act_mul``, SiLU or GELU-tanh: SlotModel probes the MLP's activation before using it)."""

    FORMAT = "int4_fused"

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, group: int, in_features: int,
                 sizes: list[int], ops=None, block: int | None = None) -> None:
        super().__init__()
        self.packed, self.scale_zeros, self.group, self.ops, self.block = packed, scale_zeros, group, ops, block
        self.in_features, self.out_features = in_features, sum(sizes)
        on_kernel = ops is not None and block is not None and packed.shape[0] % block == 0
        if not on_kernel:
            self.ops = self.block = None
        self.pairs = on_kernel and len(sizes) == 2 and sizes[0] == sizes[1] and sizes[0] % block == 0
        self.bf16_dot = False  # prefill rows in bf16 on vdpbf16ps (the engine's bf16 mode sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is None or x.dtype != torch.float32:
            return _aten_int4(x, self.packed, self.scale_zeros, self.group)
        return self.ops.int4_linear(x, self.packed, self.scale_zeros, self.group, self.block, bf16_dot=self.bf16_dot)

    def act_mul(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """``act(gate) * up`` of a ``pairs`` projection, ``act`` one of linear.ACTS."""
        if x.dtype != torch.float32:
            gu = _aten_int4(x, self.packed, self.scale_zeros, self.group)
            n = gu.shape[-1] // 2
            f = torch.nn.functional
            g = f.silu(gu[..., :n]) if act == "silu" else f.gelu(gu[..., :n], approximate="tanh")
            return g * gu[..., n:]
        return self.ops.int4_linear(x, self.packed, self.scale_zeros, self.group, self.block, act=ACTS[act],
                                    bf16_dot=self.bf16_dot)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_mul(x, "silu")

    def stack_spec(self, gate_up: bool, act: str = "silu") -> StackSpec | None:
        if self.ops is None or (gate_up and not self.pairs):
            return None
        return StackSpec(PAIR_KINDS[act][1] if gate_up else INT4, self.packed, self.scale_zeros, NONE, self.group,
                         self.block)


def int4_on_kernels(model: nn.Module, ops) -> int:
    """Swap the model's resident Int4CpuLinears (output size a multiple of the pack's row block) for
    Int4KernelLinear; returns how many. After ``fuse_int4``: the fused ones' packed weights are views by then."""
    block = int4_block() if ops is not None else None
    if block is None:
        return 0
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if weight_format(child) == "int4_cpu" and is_resident(child) \
                    and child.out_features % block == 0 and child.packed.is_contiguous():
                setattr(parent, name, Int4KernelLinear(child, ops, block))
                n += 1
    return n


def fuse_int4(mods: list[nn.Module], ops=None) -> FusedInt4Linear | None:
    """One FusedInt4Linear computing ``cat([m(x) for m in mods], -1)`` for resident, bias-free int4_cpu
    Int4CpuLinears of one input size, group size and dtype; None where they cannot be fused."""
    if not all(weight_format(m) == "int4_cpu" and m.bias is None and is_resident(m) for m in mods):
        return None
    if len({(m.in_features, m.group_size, m.scale_zeros.dtype) for m in mods}) != 1:
        return None
    if not _pack_concatenates(tuple(m.out_features for m in mods)):
        return None
    packed = torch.cat([m.packed for m in mods])
    scale_zeros = torch.cat([m.scale_zeros for m in mods], dim=1).contiguous()
    off = 0
    for m in mods:  # the originals read slices of the fused pack: one copy in memory
        m.packed = packed[off:off + m.out_features]
        off += m.out_features
    block = int4_block() if ops is not None else None
    return FusedInt4Linear(packed, scale_zeros, mods[0].group_size, mods[0].in_features,
                           [m.out_features for m in mods], ops, block)
