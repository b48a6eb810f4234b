"""Where training memory goes: parameters, gradients, optimizer state and activations.

Activation memory is measured, not estimated: during one forward pass every tensor autograd saves
for backward passes through a saved_tensors_hooks pack hook, and we sum the bytes of each distinct
storage once, skipping parameters (they are weights, not activations). With non-reentrant
checkpointing only the checkpoint inputs are saved outside the recompute, so the same hook sees
exactly what checkpointing keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ActivationMeter:
    """Context manager: bytes of distinct storages saved for backward, excluding parameters."""

    def __init__(self, model: torch.nn.Module):
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()
        self.bytes = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._param_ptrs and ptr not in self._seen and storage.nbytes() > 0:
            self._seen.add(ptr)
            self.bytes += storage.nbytes()
        return t

    def __enter__(self) -> ActivationMeter:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


@dataclass
class MemoryReport:
    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    peak_cuda: int | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "extra"} | self.extra

    def table(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state), ("activations (per micro-batch)", self.activations)]
        if self.peak_cuda is not None:
            rows.append(("peak CUDA allocated", self.peak_cuda))
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{width}}  {mib(b):>10}" for name, b in rows)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def fill_static(report: MemoryReport, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    params = list(model.parameters())
    report.parameters = tensor_bytes(params)
    report.gradients = tensor_bytes(p.grad for p in params if p.grad is not None)
    report.optimizer_state = tensor_bytes(
        v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)
    )
    if torch.cuda.is_available():
        report.peak_cuda = torch.cuda.max_memory_allocated()
