"""What a quantization method gets for one decoder layer: its modules, arguments and calibration inputs.

`run` forwards the layer over the calibration batches. A method that compresses the Linears group by group in
execution order (GPTQ, SparseGPT) forwards the layer once per group, and the later passes recompute modules
that can no longer change: once every Linear of a direct child (self_attn after o_proj) is `done`, the child's
output is recorded the next time it runs in full and replayed in the later passes, the walk's output pass
included. On Gemma 3 270M this removes the attention block from three of the five passes per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from compress.quant import QuantArgs

Batch = tuple[tuple[Any, ...], dict[str, Any]]  # positional args (hidden_states first) and kwargs of a layer call


class _Stop(Exception):
    pass


def _storable(out: Any) -> bool:
    """A child output the memo can keep: a tensor, or a tuple of one tensor and Nones (attention without
    weights); anything else (attention probabilities, caches) would cost memory or change between passes."""
    if isinstance(out, torch.Tensor):
        return True
    return isinstance(out, tuple) and bool(out) and isinstance(out[0], torch.Tensor) and all(o is None for o in out[1:])


def _clone(out: Any) -> Any:  # downstream code may write into a module output in place: keep our own copy
    return out.clone() if isinstance(out, torch.Tensor) else (out[0].clone(), *out[1:])


@dataclass
class LayerJob:
    layer: nn.Module
    prefix: str  # e.g. "model.layers.3."
    linears: dict[str, nn.Linear]  # relative name -> Linear to quantize
    args: dict[str, QuantArgs]  # relative name -> quantization args (group size resolved per layer)
    config: Any  # the model's PretrainedConfig
    inputs: list[Batch] = field(default_factory=list)  # calibration inputs, one entry per batch
    options: dict[str, Any] = field(default_factory=dict)  # method options (act_order, ...)
    finished: set[str] = field(default_factory=set)  # Linears whose weights are final (`done`)
    memo: dict[str, dict[int, Any] | None] = field(default_factory=dict)  # final child -> output per batch index
    # (None: the child is called more than once per layer call or returns more than a tensor: never replayed)

    def done(self, names: Iterable[str]) -> None:
        """These Linears have their final weights. Call it in execution order (gptq.sequential_groups): a
        direct child of the layer whose target Linears are all done then reads only final inputs, so its
        output is the same in every later pass and is memoized."""
        self.finished.update(names)
        for child, _ in self.layer.named_children():
            mine = [n for n in self.linears if n.startswith(child + ".")]
            if mine and all(n in self.finished for n in mine) and child not in self.memo:
                self.memo[child] = {}

    def _replaying(self, batch: list[int], hooked: Iterable[str]) -> list[Callable[[], None]]:
        """Wrap each memoized child's forward: replay the recorded output of batch[0] or record it. A child
        holding a hooked module runs for real (a replay would hide that module's input from the hook)."""
        undo = []
        live = [n for n, rec in self.memo.items() if rec is not None and not any(h.startswith(n + ".") for h in hooked)]
        for name in live:
            mod = self.layer.get_submodule(name)
            orig = mod.forward
            calls: dict[int, int] = {}

            def forward(*a: Any, _name: str = name, _orig: Callable[..., Any] = orig,
                        _calls: dict[int, int] = calls, **k: Any) -> Any:
                b = batch[0]
                _calls[b] = _calls.get(b, 0) + 1
                rec = self.memo.get(_name)
                if rec is None or _calls[b] > 1:  # a second call in one layer call: stop memoizing this child
                    self.memo[_name] = None
                    return _orig(*a, **k)
                if b in rec:
                    return _clone(rec[b])
                out = _orig(*a, **k)
                if _storable(out):
                    rec[b] = _clone(out)
                else:
                    self.memo[_name] = None
                return out

            own = mod.__dict__.get("forward")  # an instance forward someone else set (accelerate's hooks) stays
            mod.forward = forward
            undo.append(lambda m=mod, own=own: setattr(m, "forward", own) if own is not None else delattr(m, "forward"))
        return undo

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
        batch = [0]
        undo = self._replaying(batch, hooks or {})
        outs = []
        try:
            with torch.no_grad():
                for b, (args, kwargs) in enumerate(self.inputs):
                    batch[0] = b
                    pending = set(hooks or {})
                    try:
                        out = self.layer(*args, **kwargs)
                    except _Stop:
                        continue
                    outs.append(out[0] if isinstance(out, tuple) else out)
        finally:
            for h in handles:
                h.remove()
            for u in undo:
                u()
        return outs
