"""The one Linear protocol of memfit's runtime: every weight format is a module with the same small interface.

As vLLM's ``QuantizeMethodBase`` (create_weights / apply / process_weights_after_loading) or gpt-fast's
quant handlers: a format is packed from its weights once, at load (the class's constructor, or
``pack_linears`` / ``fuse`` choosing it), then only applied. What a format exposes:

- ``in_features``, ``out_features`` and ``forward(x)`` (apply), as ``nn.Linear``;
- ``FORMAT``: its name, shown by /health and in plans;
- ``stack_spec(gate_up, act)``: what the C++ layer loop (``fast_stack``, ``csrc/stack.h``: ``LinearSpec``)
  needs to run it (with ``gate_up``: as an MLP's gate/up pairs with activation ``act``), or None where that loop
  cannot;
- ``pairs`` and ``act_mul(x, act)`` where the format computes an MLP's ``act(gate) * up`` in its epilogue (``act``
  one of ``ACTS``: "silu", "gelu_tanh"; ``silu_mul(x)`` is ``act_mul(x, "silu")``).

The formats: ``dense.PanelLinear`` (fp32 or weight-only int8 on memfit's panel GEMM), ``dense.OneDNNLinear``
(fp32 on oneDNN's reordered weight), ``dense.FusedSlice`` (one projection of a fused one),
``int4.Int4KernelLinear`` / ``int4.FusedInt4Linear`` (torch's CPU int4 pack on memfit's kernel, or on aten's
where memfit's is not built), ``qlinear.Int4CpuLinear`` / ``Int4CudaLinear`` / ``DequantLinear`` (a compress
output on torch's CPU int4 pack, on CUDA's, or dequantized per call), and the modules memfit does not own:
``nn.Linear`` (dense fallback), torch's dynamic int8 Linear and bitsandbytes' Linear4bit / Linear8bitLt,
recognized here only.
``weight_format`` is the one place that tells them apart.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

# csrc/stack.h: LinearKind
PANEL, PANEL_SILU_PAIRS, INT4, INT4_GATE_UP, PANEL_GELU_PAIRS, INT4_GATE_UP_GELU = 0, 1, 2, 3, 4, 5
NONE = torch.empty(0)  # "this projection has no such tensor" for the C++ loop
# the activations the kernels apply to (gate, up) pairs, as csrc/common.h's Act: y = act(gate) * up
ACTS = {"silu": 1, "gelu_tanh": 2}
PAIR_KINDS = {"silu": (PANEL_SILU_PAIRS, INT4_GATE_UP), "gelu_tanh": (PANEL_GELU_PAIRS, INT4_GATE_UP_GELU)}


def activation(fn) -> str | None:
    """Which of ``ACTS`` an MLP's ``act_fn`` computes (SiLU; GELU's tanh approximation, as HF's
    gelu_pytorch_tanh and gelu_new), or None. Probed on a fixed input once, as ``rms_norm_weight`` probes
    norms, rather than read from class names."""
    return _probe(fn, ACTS)


# the activations the C++ layer loop applies between a non-gated MLP's up and down projections (GPT-2's gelu_new,
# GPT-NeoX's exact GELU), as csrc/stack.h's PlainAct
PLAIN_ACTS = {"gelu_tanh": 1, "gelu": 2, "relu": 3, "silu": 4}


def plain_activation(fn) -> str | None:
    """Which of ``PLAIN_ACTS`` a non-gated MLP's activation computes, or None (probed as ``activation``)."""
    return _probe(fn, PLAIN_ACTS)


def _probe(fn, names) -> str | None:
    if not callable(fn):
        return None
    x = torch.linspace(-8, 8, 161)
    try:
        with torch.no_grad():
            y = fn(x)
    except Exception:  # noqa: BLE001 - anything the probe cannot run is not an activation we know
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != torch.float32:
        return None
    F = torch.nn.functional
    refs = {"silu": F.silu(x), "gelu_tanh": F.gelu(x, approximate="tanh"), "gelu": F.gelu(x), "relu": F.relu(x)}
    for name in names:
        if torch.allclose(y, refs[name], atol=1e-6, rtol=1e-5):
            return name
    return None


class StackSpec(NamedTuple):
    """One projection as the C++ layer loop takes it (csrc/stack.h: LinearSpec): panel (a = packed fp32 or int8,
    b = bias, c = int8's per-output scale) or int4 (a = packed, b = scale_zeros, c = bias)."""

    kind: int
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    group: int
    block: int


@runtime_checkable
class StackableLinear(Protocol):
    """A packed format the C++ layer loop may run."""

    in_features: int
    out_features: int

    def stack_spec(self, gate_up: bool, act: str = "silu") -> StackSpec | None: ...


def is_torch_int8(m: nn.Module) -> bool:
    """A torch dynamic-quantized Linear (``serve --quantize int8``) with symmetric qint8 weights."""
    if type(m).__module__ != "torch.ao.nn.quantized.dynamic.modules.linear" or type(m).__name__ != "Linear":
        return False
    w = m.weight()
    if w.dtype != torch.qint8:
        return False
    if w.qscheme() == torch.per_tensor_affine:
        return w.q_zero_point() == 0
    return w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric) and w.q_per_channel_axis() == 0 \
        and not w.q_per_channel_zero_points().any()


def weight_format(m: nn.Module) -> str | None:
    """The weight format of a Linear-like module, or None for anything else: a memfit format's ``FORMAT``;
    "fp" for a plain ``nn.Linear`` (any float dtype); "torch_int8" for torch's dynamic int8 Linear;
    "bnb_nf4" / "bnb_int8" for bitsandbytes' Linear4bit / Linear8bitLt."""
    fmt = getattr(type(m), "FORMAT", None)
    if isinstance(fmt, str):
        return getattr(m, "format", fmt)
    if type(m) is nn.Linear:
        return "fp"
    if is_torch_int8(m):
        return "torch_int8"
    name = type(m).__name__
    if type(m).__module__.startswith("bitsandbytes"):
        return {"Linear4bit": "bnb_nf4", "Linear8bitLt": "bnb_int8"}.get(name)
    return None


def is_resident(m: nn.Module) -> bool:
    """All of the module's tensors are real tensors in memory: no offload hook, no meta, no tensor-parallel
    shards (DTensor) or tensor subclasses (bitsandbytes) that a packed format could not read."""
    if getattr(m, "_hf_hook", None) is not None:
        return False
    return all(not t.is_meta and type(t) in (torch.Tensor, nn.Parameter)
               for t in m.state_dict().values() if isinstance(t, torch.Tensor))


def format_counts(model: nn.Module) -> dict[str, int]:
    """How many Linear-like modules of each weight format the model holds (a fused projection counts once)."""
    out: dict[str, int] = {}
    for m in model.modules():
        fmt = weight_format(m)
        if fmt is not None:
            out[fmt] = out.get(fmt, 0) + 1
    return out
