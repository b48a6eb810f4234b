"""Which layers share a block table in the paged KV cache: a model's KV groups, so that sliding-window layers can
give back the blocks behind their window while a sequence runs.

A sliding layer (Gemma 2/3, Mistral, Qwen2 and Phi-3 windows) never reads a key ``window`` or more positions behind
its query, so its blocks behind the window are dead; a full-attention layer reads every block. Layers are grouped
by window (None: full attention), every group the same number of layers (the gcd of each window's layer count).
One pool of blocks serves every group, a block being ``size`` layers deep, and each group has its own block table,
the scheme of vLLM's hybrid KV cache manager (vllm/v1/core/kv_cache_coordinator.py). The i-th layer of every group
shares one cache tensor (a block belongs to one group at a time), so the cache is ``size`` tensors of
``num_blocks`` blocks.

Gemma 3 270M: 15 sliding layers (window 512) and 3 full ones make 6 groups of 3. A 2048-token sequence decoding
holds 3 x 128 + 15 x 33 layer-blocks of 16 tokens instead of 18 x 128: 0.38x the memory (0.49x while prefilled in
256-token chunks: ``blocks_held``). A model without sliding layers is one group of all its layers, the cache as
before. Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NULL_BLOCK = -1  # a sliding group's entry for a block behind its window, given back (the table's entry is stale)


# config.json names of GPT-2 style configs (HF's config classes map them as attribute_map; a dict does not)
_ALIASES = {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head", "hidden_size": "n_embd"}


def config_value(config, key: str):
    """``key`` of an HF config or config.json's dict (multimodal configs: from ``text_config``; GPT-2's
    ``n_layer``-style names)."""
    if isinstance(config, dict):
        v = config.get(key, config.get(_ALIASES.get(key, key)))
        if v is None and isinstance(config.get("text_config"), dict):  # Gemma 3's multimodal checkpoints
            v = config_value(config["text_config"], key)
        return v
    return getattr(config, key, None)


def layer_windows(config, max_seq_len: int) -> list[int | None]:
    """Each layer's sliding window, None where it attends to every position (or its window never limits a
    sequence of ``max_seq_len`` positions). ``layer_types`` names the sliding layers where the config has it
    (Gemma 2/3, Qwen2/3 in transformers 5); otherwise ``sliding_window`` applies to every layer (Mistral, Phi-3)
    or, with ``max_window_layers`` (Qwen2), to the layers from that index on, unless ``use_sliding_window`` is
    false."""
    n = int(config_value(config, "num_hidden_layers"))
    w = config_value(config, "sliding_window")
    w = int(w) if w and int(w) < max_seq_len else None
    types = config_value(config, "layer_types")
    if types is not None:
        return [w if t == "sliding_attention" else None for t in types]
    if config_value(config, "use_sliding_window") is False:
        return [None] * n
    first = config_value(config, "max_window_layers")
    return [w if first is None or i >= int(first) else None for i in range(n)]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks covering positions ``0 .. num_tokens - 1``."""
    return -(-num_tokens // block_size)


def first_live_block(next_pos: int, window: int | None, block_size: int) -> int:
    """The first block a query at ``next_pos`` (or after) can read: HF's rule, key j is seen by query i when
    ``i - window < j``; every block before it is dead. 0 for a full-attention layer."""
    return max(0, next_pos - window + 1) // block_size if window else 0


@dataclass(frozen=True)
class KVGroups:
    """``layers[g]``: the layer indices of group ``g`` (all of one window, ``windows[g]``), each group equally
    many."""

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        """Layers per group: how many cache tensors there are, and how deep one block is."""
        return len(self.layers[0])

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)

    @property
    def sliding_windows(self) -> list[int]:
        """The distinct sliding windows, ascending ([] without sliding layers): /health's and serve plan's."""
        return sorted({w for w in self.windows if w})

    def of_layer(self, num_layers: int) -> list[tuple[int, int]]:
        """Per layer: (its group, its index in the group, i.e. the cache tensor it uses)."""
        out = [(0, 0)] * num_layers
        for g, layers in enumerate(self.layers):
            for i, li in enumerate(layers):
                out[li] = (g, i)
        return out

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int) -> int:
        return blocks_held(self.windows, num_tokens, block_size, chunk)


def blocks_held(windows: tuple[int | None, ...], num_tokens: int, block_size: int, chunk: int) -> int:
    """The most blocks (over groups of ``windows``) one sequence holds while it computes its first ``num_tokens``
    positions in steps of at most ``chunk`` tokens: a sliding group holds its window and the step's tokens,
    ``window - 1 + chunk`` positions, which may straddle one more block."""
    full = blocks_for(num_tokens, block_size)
    return sum(full if w is None else min(full, blocks_for(w - 1 + chunk, block_size) + 1) for w in windows)


def group_layers(windows: list[int | None]) -> KVGroups:
    """Group layers by window, ``gcd`` of the windows' layer counts per group, in layer order."""
    by_window: dict[int | None, list[int]] = {}
    for li, w in enumerate(windows):
        by_window.setdefault(w, []).append(li)
    size = math.gcd(*(len(v) for v in by_window.values()))
    ws, layers = [], []
    for w, lis in by_window.items():
        for i in range(0, len(lis), size):
            ws.append(w)
            layers.append(tuple(lis[i:i + size]))
    return KVGroups(tuple(ws), tuple(layers))
