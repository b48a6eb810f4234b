"""Rotary position embeddings for SlotModel, from the model's own rotary module (so every RoPE variant that
transformers implements is matched exactly), one table per layer kind.

Models with several kinds of layers (Gemma 3: sliding layers at RoPE base 10k, full ones at 1M) pass the
layer type to their rotary module; SlotModel asks once per kind and step. Static variants (cos/sin depend on
the position only) are computed once for every position and looked up: a gather instead of the module's ~8
ops per step.
"""

from __future__ import annotations

import inspect

import torch


class Rope:
    def __init__(self, rotary: torch.nn.Module, layer_types: list[str | None], max_seq_len: int, head_dim: int):
        self.rotary = rotary
        takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
        # the key of each layer's table: its layer type where the rotary module tells types apart, else None
        self.layer_kinds: list[str | None] = [t if takes_type else None for t in layer_types]
        self.kinds = list(dict.fromkeys(self.layer_kinds))
        rope_type = getattr(rotary, "rope_type", "default")
        names = [str(x) for x in (rope_type.values() if isinstance(rope_type, dict) else [rope_type])]
        self.static = all("dynamic" not in x and x != "longrope" for x in names) and \
            max_seq_len * head_dim * len(self.kinds) <= 2 ** 22
        self.max_seq_len = max_seq_len
        self._tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}

    def _call(self, h: torch.Tensor, positions: torch.Tensor, kind: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        if kind is None:
            return self.rotary(h, positions)
        return self.rotary(h, positions, kind)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor,
                 kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` for the layers of ``kind`` at ``positions`` ([T])."""
        if not self.static:
            cos, sin = self._call(h, positions[None].to(h.device), kind)
            return cos[0][:, None, :], sin[0][:, None, :]
        t = self._tables.get(kind)
        if t is None or t[0].dtype != h.dtype or t[0].device != h.device:
            every = torch.arange(self.max_seq_len, device=h.device)[None]
            cos, sin = self._call(h, every, kind)
            t = self._tables[kind] = (cos[0][:, None, :].contiguous(), sin[0][:, None, :].contiguous())
        ix = positions.to(h.device)
        return t[0][ix], t[1][ix]
