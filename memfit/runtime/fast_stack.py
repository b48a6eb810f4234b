"""SlotModel's decoder layers as one C++ call (memfit.runtime.kernels' ``LayerStack``, csrc/stack.cpp).

Used when every layer is on the fast path already: CPU, fp32 activations and KV cache, no offload hooks or
tensor-parallel shards, Llama-family RMSNorms, no q/k norms (qwen3 stays on the Python loop), static RoPE,
fused q/k/v, and every projection on memfit.runtime.kernels' panel (fp32 or int8) or int4 kernels with unpadded outputs.
The Python loop in memfit.runtime.slot_model is the reference (tests compare the two) and runs everything else.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.runtime.linear import StackableLinear, StackSpec


def _spec(m: nn.Module | None, gate_up: bool) -> StackSpec | None:
    """What the C++ loop needs to run projection ``m`` (the Linear protocol's ``stack_spec``), or None."""
    return m.stack_spec(gate_up) if isinstance(m, StackableLinear) else None


def _norm(norm: nn.Module) -> torch.Tensor | None:
    w = getattr(norm, "weight", None)
    if w is None or getattr(norm, "variance_epsilon", None) is None or w.dtype != torch.float32 or \
            w.device.type != "cpu" or getattr(norm, "_hf_hook", None) is not None or \
            not type(norm).__name__.endswith("RMSNorm"):
        return None
    return w.detach()


def build(sm) -> object | None:
    """A LayerStack over ``sm``'s layers, or None where any layer needs the Python loop."""
    ops = sm.ops
    if ops is None or not hasattr(ops, "LayerStack") or not sm.rope.static or sm.prefetch.enabled or \
            sm.rope.kinds != [None] or any(sm.windows) or any(sm.sandwich):
        return None
    if sm.dtype != torch.float32 or any(d.type != "cpu" for d in sm.layer_devices) or \
            any(k.dtype != torch.float32 for k in sm.k_cache):
        return None
    cols: dict[str, list] = {k: [] for k in ("norm_in", "norm_post", "kinds", "a", "b", "c", "groups", "blocks")}
    eps = None
    for li, layer in enumerate(sm.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "q_norm") or sm.act_pairs[li] != "silu":  # the MLP as silu(gate) * up pairs
            return None
        norms = [_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)]
        if any(n is None for n in norms):
            return None
        e = {layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon}
        if len(e) != 1 or (eps is not None and e != {eps}):
            return None
        eps = e.pop()
        specs = [_spec(sm.qkv[li], False), _spec(attn.o_proj, False), _spec(sm.gate_up[li], True),
                 _spec(mlp.down_proj, False)]
        if any(s is None for s in specs):
            return None
        cols["norm_in"].append(norms[0])
        cols["norm_post"].append(norms[1])
        for kind, a, b, c, group, block in specs:
            cols["kinds"].append(kind)
            cols["a"].append(a)
            cols["b"].append(b)
            cols["c"].append(c)
            cols["groups"].append(group)
            cols["blocks"].append(block)
    return ops.LayerStack(cols["norm_in"], cols["norm_post"], float(eps), cols["kinds"], cols["a"], cols["b"],
                          cols["c"], cols["groups"], cols["blocks"], sm.k_cache, sm.v_cache, sm.num_heads,
                          sm.num_kv, sm.head_dim, float(sm.scale))
