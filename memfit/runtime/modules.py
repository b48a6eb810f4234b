"""What SlotModel needs to know about an HF module before calling it: how many tensor-parallel ranks share it,
on which device it computes, and whether its ``forward`` can be called without ``nn.Module.__call__``."""

from __future__ import annotations

import torch


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
