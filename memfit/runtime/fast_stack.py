"""SlotModel's decoder layers as one C++ call (memfit.runtime.kernels' ``LayerStack``, csrc/stack.cpp).

Used when every layer is on the fast path already: CPU, fp32 activations, an fp32 or int8 KV cache, no offload
hooks or tensor-parallel shards, static RoPE, fused q/k/v, RMSNorms that SlotModel runs as one fused op
(``rms_norm_weight``: Llama's w, Gemma's 1 + w; an eps per norm), the MLP as gate/up pairs with its activation
(SiLU or GELU-tanh) in the GEMM's epilogue, and every projection on memfit.runtime.kernels' panel (fp32 or int8)
or int4 kernels with unpadded outputs. What the layers may have beyond Llama's: q/k norms per head (qwen3,
Gemma 3), Gemma's sandwich norms around attention and MLP, a RoPE table per layer type (Gemma 3's local and
global bases) and sliding windows per layer (Gemma 2/3, Mistral, Qwen2). Embedding scaling and the final
norm / soft-capping stay in SlotModel. The Python loop in memfit.runtime.slot_model is the reference (tests
compare the two) and runs everything else.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.runtime.linear import NONE, StackableLinear, StackSpec


def _spec(m: nn.Module | None, gate_up: bool, act: str = "silu") -> StackSpec | None:
    """What the C++ loop needs to run projection ``m`` (the Linear protocol's ``stack_spec``), or None."""
    return m.stack_spec(gate_up, act) if isinstance(m, StackableLinear) else None


def _norm(sm, norm: nn.Module | None) -> tuple[torch.Tensor, float] | None:
    """(weight as the norm multiplies by it, eps) of an RMSNorm the C++ loop can run, or None."""
    spec = sm._norms.get(id(norm)) if norm is not None else None
    return spec if spec is not None and spec[0].device.type == "cpu" else None


def _layer_norms(sm, layer: nn.Module, sandwich: bool) -> list[tuple[torch.Tensor, float] | None] | None:
    """The layer's norms in csrc/stack.h's NormSlot order (None where it has none of that kind), or None where one
    it has cannot run in the C++ loop."""
    attn = layer.self_attn
    mods = [layer.input_layernorm, layer.post_attention_layernorm,
            getattr(layer, "pre_feedforward_layernorm", None) if sandwich else None,
            getattr(layer, "post_feedforward_layernorm", None) if sandwich else None,
            getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    needed = [True, True, sandwich, sandwich, hasattr(attn, "q_norm"), hasattr(attn, "q_norm")]
    out = []
    for slot, (m, need) in enumerate(zip(mods, needed, strict=True)):
        spec = _norm(sm, m) if need else None
        if need and (spec is None or (slot >= 4 and spec[0].numel() != sm.head_dim)):  # q/k: per head
            return None
        out.append(spec)
    return out


def build(sm) -> object | None:
    """A LayerStack over ``sm``'s layers, or None where any layer needs the Python loop."""
    ops = sm.ops
    if ops is None or not hasattr(ops, "LayerStack") or not sm.rope.static or sm.prefetch.enabled:
        return None
    if sm.dtype != torch.float32 or any(d.type != "cpu" for d in sm.layer_devices) or \
            any(k.dtype not in (torch.float32, torch.int8) for k in sm.k_cache):
        return None
    table = {kind: i for i, kind in enumerate(sm.rope.kinds)}  # SlotModel passes the tables in this order
    cols: dict[str, list] = {k: [] for k in ("norms", "eps", "kinds", "a", "b", "c", "groups", "blocks")}
    for li, layer in enumerate(sm.layers):
        act = sm.act_pairs[li]  # the MLP as act(gate) * up pairs (panel or int4)
        norms = _layer_norms(sm, layer, sm.sandwich[li])
        if act is None or norms is None:
            return None
        specs = [_spec(sm.qkv[li], False), _spec(layer.self_attn.o_proj, False), _spec(sm.gate_up[li], True, act),
                 _spec(layer.mlp.down_proj, False)]
        if any(s is None for s in specs):
            return None
        for spec in norms:
            cols["norms"].append(NONE if spec is None else spec[0])
            cols["eps"].append(0.0 if spec is None else float(spec[1]))
        for kind, a, b, c, group, block in specs:
            cols["kinds"].append(kind)
            cols["a"].append(a)
            cols["b"].append(b)
            cols["c"].append(c)
            cols["groups"].append(group)
            cols["blocks"].append(block)
    ropes = [table[k] for k in sm.rope.layer_kinds]
    windows = [w or 0 for w in sm.windows]
    return ops.LayerStack(cols["norms"], cols["eps"], cols["kinds"], cols["a"], cols["b"], cols["c"], cols["groups"],
                          cols["blocks"], sm.k_cache, sm.v_cache, [NONE if s is None else s for s in sm.k_scale],
                          [NONE if s is None else s for s in sm.v_scale], ropes, windows, sm.num_heads, sm.num_kv,
                          sm.head_dim, float(sm.scale), sm.bf16_dot)
