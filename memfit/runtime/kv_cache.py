"""SlotModel's KV cache tensors: each layer's K and V (and int8 scales), and the block tables that map a slot's
positions to blocks, one table per KV group (kv_groups.py).

A layer's cache is ``[num_blocks, kv_heads, block_size, head_dim]``. In a paged cache on one device, the i-th
layer of every KV group shares one tensor (a block belongs to one group at a time), so there are ``groups.size``
tensors; otherwise (static slots, several devices) every layer has its own, on the device that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.runtime.kv_groups import KVGroups, group_layers


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer (shared between groups)
    v: list[torch.Tensor]
    k_scale: list[torch.Tensor | None]  # int8 K/V: a scale per (block, KV head, row); None for float caches
    v_scale: list[torch.Tensor | None]
    tables: torch.Tensor  # [groups, slots, blocks per sequence]: tables[g, slot] lists the slot's blocks in group g
    groups: KVGroups
    layer_group: list[int]  # per layer: its group (which table it reads)


def make_kv_cache(devices: list[torch.device], windows: list[int | None], paged: bool, num_blocks: int,
                  block_size: int, max_batch: int, max_seq_len: int, num_kv: int, head_dim: int,
                  dtype: torch.dtype) -> KVCache:
    """Zeroed caches for layers on ``devices`` with sliding ``windows``; static slots (``paged`` False) own block
    ``slot`` each."""
    one_device = len(set(devices)) == 1
    groups = group_layers(windows if paged and one_device else [None] * len(devices))
    where = groups.of_layer(len(devices))  # per layer: (group, cache tensor)
    tables = torch.zeros(len(groups), max_batch, -(-max_seq_len // block_size), dtype=torch.long)
    if not paged:
        tables[0, :, 0] = torch.arange(max_batch)
    shape = (num_blocks, num_kv, block_size, head_dim)
    sdt = torch.float32 if dtype == torch.int8 else None
    made: dict = {}
    per_layer = []  # (K, V, K scale, V scale) of each layer
    for li, d in enumerate(devices):
        key = (d, where[li][1])
        if key not in made:
            made[key] = tuple(torch.zeros(sh, dtype=dt, device=d) if dt is not None else None
                              for sh, dt in ((shape, dtype), (shape, dtype), (shape[:3], sdt), (shape[:3], sdt)))
        per_layer.append(made[key])
    k, v, ks, vs = ([t[i] for t in per_layer] for i in range(4))
    return KVCache(k, v, ks, vs, tables, groups, [g for g, _ in where])


def bytes_per_device(k: list[torch.Tensor], k_scale: list[torch.Tensor | None]) -> dict[str, int]:
    """K and V bytes (scales included) on each device, every shared tensor once."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for t, s in zip(k, k_scale, strict=True):
        if id(t) in seen:
            continue
        seen.add(id(t))
        n = t.numel() * t.element_size() + (s.numel() * s.element_size() if s is not None else 0)
        out[str(t.device)] = out.get(str(t.device), 0) + 2 * n
    return out


def assign_blocks(tables: torch.Tensor, num_blocks: int, rows: int, per_row: int, wrap: bool = False) -> None:
    """Slots 0..rows-1 each take their own ``per_row`` blocks in every group, as serve's scheduler would (fit's
    quality probe, the warm-up, tests). ``wrap``: reuse blocks when there are too few (warm-up only: slots then
    share blocks)."""
    groups = tables.shape[0]
    need = groups * rows * per_row
    if need > num_blocks and not wrap:
        raise ValueError(f"{rows} slots of {per_row} blocks in {groups} KV groups need {need} blocks, the cache "
                         f"has {num_blocks}")
    tables[:, :rows, :per_row] = (torch.arange(need) % num_blocks).view(groups, rows, per_row)
