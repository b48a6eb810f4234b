"""What SlotModel needs to know about an HF module before calling it: how many tensor-parallel ranks share it,
on which device it computes, whether its ``forward`` can be called without ``nn.Module.__call__``, its norm's
weight; and two rewrites (Phi-3's fused projections split, bf16 leftovers widened)."""

from __future__ import annotations

import torch

from memfit.runtime.linear import weight_format


def tp_shards(linear: torch.nn.Module) -> int:
    """How many tensor-parallel ranks share this (column-sharded) Linear: 1 unless its weight is a DTensor."""
    w = getattr(linear, "weight", None)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return 1
    if isinstance(w, DTensor):
        return w.shape[0] // w.to_local().shape[0]
    return 1


def exec_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: its accelerate hook's execution device (offloaded weights are on meta until
    the hook loads them), else the device of its first real parameter, else CPU."""
    for m in module.modules():
        hook = getattr(m, "_hf_hook", None)
        dev = getattr(hook, "execution_device", None)
        if dev is not None:
            return torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}")
    for p in module.parameters():
        if not p.is_meta:
            return p.device if not hasattr(p, "to_local") else p.to_local().device
    return torch.device("cpu")


def plain_forward(module: torch.nn.Module):
    """``module.forward`` where calling it is the same as calling the module (no forward hooks of its own or
    global ones, checked once at load; accelerate's hooks wrap ``forward`` itself and so still run), else the
    module."""
    from torch.nn.modules import module as nn_module

    if not isinstance(module, torch.nn.Module):
        return module
    hooks = (module._forward_hooks, module._forward_pre_hooks, nn_module._global_forward_hooks,
             nn_module._global_forward_pre_hooks)
    return module if any(hooks) else module.forward


def rms_norm_weight(norm: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    """(w, eps) such that ``norm(x) == x * rsqrt(mean(x^2) + eps) * w`` for fp32 x, or None (then the module runs).

    Llama-family norms scale by their weight, Gemma's by (1 + weight): which one a module computes is probed
    on a random input once, not inferred from its class name."""
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if w is None or eps is None or type(w) not in (torch.Tensor, torch.nn.Parameter) or w.dim() != 1 or \
            w.dtype != torch.float32 or w.is_meta or \
            getattr(norm, "_hf_hook", None) is not None or not type(norm).__name__.endswith("RMSNorm"):
        return None
    w = w.detach()
    x = torch.randn(3, w.numel(), generator=torch.Generator().manual_seed(0)).to(w.device)
    with torch.no_grad():
        got = norm(x)
    base = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    for cand in (w, w + 1):
        if got.shape == base.shape and torch.allclose(got, base * cand, atol=1e-5, rtol=1e-5):
            return cand.contiguous(), float(eps)
    return None


# (module attribute holding a fused projection, the separate projections it concatenates along its outputs):
# Phi-3's qkv_proj = [q; k; v] and gate_up_proj = [gate; up], the Llama layout once split
_FUSED = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def split_fused_projections(layers: list[torch.nn.Module], q_rows: int, kv_rows: int) -> bool:
    """Phi-3 layers as Llama's: each plain ``nn.Linear`` qkv_proj / gate_up_proj replaced by q/k/v and gate/up
    Linears whose weights are row views of it (no copy; SlotModel and dense.pack_linears fuse them again in their
    own layout). The HF modules' own forward is not called afterwards (a model already split is left as it is).
    False (nothing changed) where a fused projection is not a plain Linear (a compress output, a tensor-parallel
    shard) or has a bias: SlotModel then calls the fused projections themselves."""
    todo = []
    for layer in layers:
        for parent_name, fused_name, parts in _FUSED:
            parent = getattr(layer, parent_name)
            fused = getattr(parent, fused_name, None)
            if fused is None:
                continue
            if type(fused) is not torch.nn.Linear or fused.bias is not None or tp_shards(fused) != 1:
                return False
            rows = (q_rows, kv_rows, kv_rows) if fused_name == "qkv_proj" else (fused.out_features // 2,) * 2
            if sum(rows) != fused.out_features:
                return False
            todo.append((parent, fused_name, parts, rows))
    for parent, fused_name, parts, rows in todo:
        w = getattr(parent, fused_name).weight
        start = 0
        for name, n in zip(parts, rows, strict=True):
            part = torch.nn.Linear(w.shape[1], n, bias=False, device="meta")
            part.weight = torch.nn.Parameter(w[start:start + n], requires_grad=False)
            setattr(parent, name, part)
            start += n
        delattr(parent, fused_name)
    return True


def float_rest(model: torch.nn.Module) -> None:
    """After the Linears are packed in bf16: every other bf16 tensor (norms, RoPE buffers, a tied lm_head that
    could not be packed) to fp32, the dtype the activations keep; an untied input embedding stays bf16 (its
    looked-up rows are widened: ``_forward``). Tensors shared by several modules stay shared."""
    def skip(m: torch.nn.Module) -> bool:  # a packed or quantized format keeps its own dtypes (bf16 panels by
        fmt = weight_format(m)  # choice, an int4 pack's bf16 scales); a plain nn.Linear ("fp") is widened
        return fmt is not None and fmt != "fp"

    used = {t.data_ptr() for m in model.modules() if not skip(m) and not isinstance(m, torch.nn.Embedding)
            for t in m.parameters(recurse=False)}
    done: dict[int, torch.Tensor] = {}
    for m in model.modules():
        if skip(m):
            continue
        for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t is None or t.dtype != torch.bfloat16 or \
                    (isinstance(m, torch.nn.Embedding) and t.data_ptr() not in used):
                continue
            is_param = isinstance(t, torch.nn.Parameter)
            if t.data_ptr() not in done:
                f = t.detach().float()
                done[t.data_ptr()] = torch.nn.Parameter(f, requires_grad=False) if is_param else f
            if is_param:
                setattr(m, name, done[t.data_ptr()])
            else:
                m._buffers[name] = done[t.data_ptr()]
