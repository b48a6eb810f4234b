"""Prefetch of offloaded decoder layers: load layer i+1's weights while layer i computes.

accelerate's offload hooks (attached by transformers' ``from_pretrained(device_map=...)`` to each leaf
module of a CPU- or disk-offloaded layer) load a module's weights right before its forward and drop them
right after, so every offloaded layer's read from disk (or copy to the GPU) sits on the critical path.
We reuse those very hooks (their weights map, tied-parameter handling and devices) but call their
``_onload_weights`` one layer ahead on a background thread; while a layer is loaded ahead its hooks'
``offload`` flag is off, so its own forward neither reloads nor drops it. The reads release the GIL
(safetensors copies, page faults), so they overlap the matmuls of the current layer. bench/placement.py
measures it against accelerate's own behaviour; it is opt-in (``--offload-prefetch``): on CPU, where
the "load" from safetensors is a zero-copy memory map, it measured no faster.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch


def _offload_hooks(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    from accelerate.hooks import AlignDevicesHook

    out = []
    for mod in layer.modules():
        hook = getattr(mod, "_hf_hook", None)
        if isinstance(hook, AlignDevicesHook) and hook.offload and hook.weights_map is not None:
            out.append((mod, hook))
    return out


class LayerPrefetcher:
    """Call ``begin(i)`` before decoder layer i runs and ``end(i)`` after; no-op for layers kept resident."""

    def __init__(self, layers: list[torch.nn.Module], enabled: bool = True):
        self.units = [_offload_hooks(layer) for layer in layers]
        self.offloaded = [i for i, u in enumerate(self.units) if u]
        self.enabled = enabled and bool(self.offloaded)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="serve-prefetch") if self.enabled else None
        self.pending: dict[int, Future] = {}
        self.loaded: set[int] = set()

    @property
    def active(self) -> bool:
        return self.enabled

    def _onload(self, i: int) -> None:
        for mod, hook in self.units[i]:
            hook._onload_weights(mod)
            hook.offload = False  # its own pre/post_forward now leave the weights alone
            for p in mod.parameters(recurse=False):
                if p.device.type == "cpu" and p.numel():
                    # from safetensors the "load" is a zero-copy memory map: fault its pages in here, off the
                    # critical path, instead of inside the layer's matmul (one read per 4 KiB page)
                    p.data.view(-1)[:: max(1, 4096 // p.element_size())].sum()
        self.loaded.add(i)

    def _offload(self, i: int) -> None:
        for mod, hook in self.units[i]:
            hook.offload = True
            hook._offload_weights(mod)
        self.loaded.discard(i)

    def _next_offloaded(self, i: int) -> int:
        later = [j for j in self.offloaded if j > i]
        return later[0] if later else self.offloaded[0]  # wrap: the next step's first offloaded layer

    def begin(self, i: int) -> None:
        if not self.enabled or not self.units[i]:
            return
        fut = self.pending.pop(i, None)
        if fut is not None:
            fut.result()
        elif i not in self.loaded:
            self._onload(i)
        nxt = self._next_offloaded(i)
        if nxt != i and nxt not in self.loaded and nxt not in self.pending:
            self.pending[nxt] = self.pool.submit(self._onload, nxt)

    def end(self, i: int) -> None:
        if self.enabled and self.units[i]:
            self._offload(i)

    def reset(self) -> None:
        """After a failed step: wait for reads in flight and drop every layer loaded ahead."""
        for fut in self.pending.values():
            try:
                fut.result()
            except Exception:  # noqa: BLE001, S110 - the step already failed; only cleanup matters here
                pass
        self.pending.clear()
        for i in list(self.loaded):
            self._offload(i)
