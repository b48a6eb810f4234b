"""SlotModel's decoder layers as one C++ call (memfit.runtime.kernels' ``LayerStack``, csrc/stack.cpp).

Used when every layer is on the fast path already: CPU, fp32 activations, an fp32 or int8 KV cache, no offload
hooks or tensor-parallel shards, static RoPE, fused q/k/v, RMSNorms that SlotModel runs as one fused op
(``rms_norm_weight``: Llama's w, Gemma's 1 + w; an eps per norm) or fp32 LayerNorms, the MLP as gate/up pairs
with its activation (SiLU or GELU-tanh) in the GEMM's epilogue or as a non-gated up / activation / down (GPT-2,
GPT-NeoX; ``PLAIN_ACTS``), and every projection on memfit.runtime.kernels' panel (fp32 or int8) or int4 kernels
with unpadded outputs. What the layers may have beyond Llama's: q/k norms per head (qwen3, Gemma 3), Gemma's
sandwich norms around attention and MLP, a RoPE table per layer type (Gemma 3's local and global bases), sliding
windows per layer (Gemma 2/3, Mistral, Qwen2) and GPT-NeoX's parallel residual. Embedding scaling, GPT-2's
learned positions and the final norm / soft-capping stay in SlotModel. The Python loop in
memfit.runtime.slot_model is the reference (tests compare the two) and runs everything else.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.runtime.linear import NONE, PLAIN_ACTS, StackableLinear, StackSpec, plain_activation


def _spec(m: nn.Module | None, gate_up: bool, act: str = "silu") -> StackSpec | None:
    """What the C++ loop needs to run projection ``m`` (the Linear protocol's ``stack_spec``), or None."""
    return m.stack_spec(gate_up, act) if isinstance(m, StackableLinear) else None


def _norm(sm, norm: nn.Module | None) -> tuple[torch.Tensor, float, torch.Tensor] | None:
    """(weight as the norm multiplies by it, eps, bias: NONE for an RMSNorm) of a norm the C++ loop can run, or
    None."""
    spec = sm._norms.get(id(norm)) if norm is not None else None
    if spec is not None:
        return (spec[0], spec[1], NONE) if spec[0].device.type == "cpu" else None
    if type(norm) is nn.LayerNorm and norm.elementwise_affine and len(norm.normalized_shape) == 1 and \
            norm.weight.dtype == torch.float32 and norm.weight.device.type == "cpu" and \
            getattr(norm, "_hf_hook", None) is None:  # GPT-2, GPT-NeoX (a LayerNorm without bias: zeros)
        bias = norm.bias.detach() if norm.bias is not None else torch.zeros_like(norm.weight.detach())
        return norm.weight.detach(), float(norm.eps), bias
    return None


def _layer_norms(sm, layer: nn.Module, sandwich: bool) -> list[tuple[torch.Tensor, float, torch.Tensor] | None] | None:
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
        if need and (spec is None or (slot >= 4 and (spec[0].numel() != sm.head_dim or spec[2].numel()))):
            return None  # q/k: RMSNorms per head
        out.append(spec)
    return out


# a non-gated MLP's (up, activation, down) attribute names: GPT-2's, GPT-NeoX's
_PLAIN_MLPS = (("c_fc", "act", "c_proj"), ("dense_h_to_4h", "act", "dense_4h_to_h"))


def _mlp(sm, li: int, layer: nn.Module) -> tuple[StackSpec | None, StackSpec | None, int] | None:
    """The MLP as the C++ loop runs it: (gate/up or up spec, down spec, csrc/stack.h's PlainAct), or None."""
    act = sm.act_pairs[li]  # the MLP as act(gate) * up pairs (panel or int4)
    if act is not None:
        return _spec(sm.gate_up[li], True, act), _spec(layer.mlp.down_proj, False), 0
    mlp = layer.mlp
    for up, act_name, down in _PLAIN_MLPS:
        if hasattr(mlp, up) and hasattr(mlp, down):
            name = plain_activation(getattr(mlp, act_name, None))
            return (_spec(getattr(mlp, up), False), _spec(getattr(mlp, down), False), PLAIN_ACTS[name]) \
                if name else None
    return None


def build(sm) -> object | None:
    """A LayerStack over ``sm``'s layers, or None where any layer needs the Python loop."""
    ops = sm.ops
    if ops is None or not hasattr(ops, "LayerStack") or not sm.rope.static or sm.prefetch.enabled:
        return None
    if sm.dtype != torch.float32 or any(d.type != "cpu" for d in sm.layer_devices) or \
            any(k.dtype not in (torch.float32, torch.int8) for k in sm.k_cache):
        return None
    table = {kind: i for i, kind in enumerate(sm.rope.kinds)}  # SlotModel passes the tables in this order
    cols: dict[str, list] = {k: [] for k in ("norms", "bias", "eps", "kinds", "a", "b", "c", "groups", "blocks",
                                             "acts")}
    for li, layer in enumerate(sm.layers):
        norms = _layer_norms(sm, layer, sm.sandwich[li])
        mlp = _mlp(sm, li, layer)
        if mlp is None or norms is None:
            return None
        specs = [_spec(sm.qkv[li], False), _spec(layer.self_attn.o_proj, False), mlp[0], mlp[1]]
        if any(s is None for s in specs):
            return None
        cols["acts"].append(mlp[2])
        for spec in norms:
            cols["norms"].append(NONE if spec is None else spec[0])
            cols["eps"].append(0.0 if spec is None else float(spec[1]))
            cols["bias"].append(NONE if spec is None else spec[2])
        for kind, a, b, c, group, block in specs:
            cols["kinds"].append(kind)
            cols["a"].append(a)
            cols["b"].append(b)
            cols["c"].append(c)
            cols["groups"].append(group)
            cols["blocks"].append(block)
    ropes = [table[k] for k in sm.rope.layer_kinds]
    windows = [w or 0 for w in sm.windows]
    return ops.LayerStack(cols["norms"], cols["bias"], cols["eps"], cols["kinds"], cols["a"], cols["b"], cols["c"],
                          cols["groups"], cols["blocks"], sm.k_cache, sm.v_cache,
                          [NONE if s is None else s for s in sm.k_scale],
                          [NONE if s is None else s for s in sm.v_scale], ropes, windows, sm.layer_group, cols["acts"],
                          [int(p) for p in sm.parallel], sm.num_heads, sm.num_kv,
                          sm.head_dim, float(sm.scale), sm.bf16_dot)
