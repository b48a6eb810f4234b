"""What a quantization method gets for one decoder layer: its modules, arguments and calibration inputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from compress.quant import QuantArgs

Batch = tuple[tuple[Any, ...], dict[str, Any]]  # positional args (hidden_states first) and kwargs of a layer call


class _Stop(Exception):
    pass


@dataclass
class LayerJob:
    layer: nn.Module
    prefix: str  # e.g. "model.layers.3."
    linears: dict[str, nn.Linear]  # relative name -> Linear to quantize
    args: dict[str, QuantArgs]  # relative name -> quantization args (group size resolved per layer)
    config: Any  # the model's PretrainedConfig
    inputs: list[Batch] = field(default_factory=list)  # calibration inputs, one entry per batch
    options: dict[str, Any] = field(default_factory=dict)  # method options (act_order, ...)

    def run(self, hooks: dict[str, Callable[[torch.Tensor], None]] | None = None,
            stop_early: bool = False) -> list[torch.Tensor]:
        """Forward the layer over every calibration batch; hooks[name](input) sees each Linear's input.

        With stop_early, each batch's forward stops once every hooked module has seen its input (no outputs).
        """
        handles = []
        pending: set[str] = set()

        def call(name: str, fn: Callable[[torch.Tensor], None], x: torch.Tensor) -> None:
            fn(x.detach())
            pending.discard(name)
            if stop_early and not pending:
                raise _Stop

        for name, fn in (hooks or {}).items():
            mod = self.layer.get_submodule(name)
            handles.append(mod.register_forward_pre_hook(lambda _m, a, n=name, fn=fn: call(n, fn, a[0])))
        outs = []
        try:
            with torch.no_grad():
                for args, kwargs in self.inputs:
                    pending = set(hooks or {})
                    try:
                        out = self.layer(*args, **kwargs)
                    except _Stop:
                        continue
                    outs.append(out[0] if isinstance(out, tuple) else out)
        finally:
            for h in handles:
                h.remove()
        return outs
