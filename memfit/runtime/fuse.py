"""Projections that read the same input (q/k/v; the MLP's gate/up) as one Linear call, whatever their format.

``dense.pack_linears`` fuses fp32 and int8 projections when it packs them (the HF modules become slices of
the fused weight); int4 compress outputs are fused here (``int4.fuse_int4``). Anything else keeps its
separate calls (``fuse`` returns None and SlotModel calls the projections one by one).
"""

from __future__ import annotations

from torch import nn

from memfit.runtime.dense import fused_of
from memfit.runtime.int4 import fuse_int4


def fuse(mods: list[nn.Module], ops=None) -> nn.Module | None:
    """A module computing ``torch.cat([m(x) for m in mods], -1)`` with one kernel call, or None."""
    return fused_of(mods) or fuse_int4(mods, ops)
