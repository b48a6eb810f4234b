"""Where training memory goes: parameters, gradients, optimizer state and activations.

Activation memory is measured, not estimated: during one forward pass every tensor autograd saves
for backward passes through a saved_tensors_hooks pack hook, and we sum the bytes of each distinct
storage once, skipping parameters (they are weights, not activations). With non-reentrant
checkpointing only the checkpoint inputs are saved outside the recompute, so the same hook sees
exactly what checkpointing keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    """Measured after step 1 (and at the end), next to the plan's prediction when one was made."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    """Bytes one micro-batch's forward saved for backward: the plan's probe measured them."""
    peak: int = 0
    """Peak memory after step 1: VmHWM on CPU, max_memory_allocated on CUDA."""
    peak_final: int = 0
    """Peak memory at the end of the run."""
    plan: Any = None
    """The training.plan.MemoryPlan made before step 1, if any."""

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "plan"}
        if self.plan is not None:
            out["predicted"] = self.plan.as_dict()
        return out

    def table(self) -> str:
        p = self.plan
        rows = [("parameters", self.parameters, p and p.parameters), ("gradients", self.gradients, p and p.gradients),
                ("optimizer state", self.optimizer_state, p and p.optimizer_state),
                ("activations (per micro-batch)", self.activations, p and p.activations),
                ("peak after step 1", self.peak, p and p.peak_first_step)]
        if self.peak_final:
            rows.append(("peak at the end (evals and saves included)", self.peak_final, p and p.peak))
        width = max(len(r[0]) for r in rows)
        head = f"{'':<{width}}  {'measured':>12}  {'predicted':>12}"
        return head + "".join(f"\n{name:<{width}}  {mib(b):>12}  {mib(q) if q else '':>12}" for name, b, q in rows)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def fill_static(report: MemoryReport, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    params = list(model.parameters())
    report.parameters = tensor_bytes(params)
    report.gradients = tensor_bytes(p.grad for p in params if p.grad is not None)
    report.optimizer_state = tensor_bytes(
        v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)
    )
    if report.plan is not None:
        report.activations = report.plan.activations
