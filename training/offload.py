"""Offloading: move what training holds between forward and backward, and the optimizer, off the device.

- `offload_activations` wraps the forward in saved_tensors_hooks: each large tensor autograd saves for backward
  goes to pinned CPU memory (mode "cpu", GPU runs) or to a file (mode "disk", CPU runs, where RAM is the limit)
  and comes back when backward needs it: activations stop filling the device, at the price of the copies.
- `CPUOffloadAdamW` is ZeRO-Offload on one device: fp32 master weights and AdamW moments live in CPU memory
  and the update runs there; the device keeps only the (e.g. bf16) weights and their gradients.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from memfit.errors import UserError


class _OnHost:
    """A saved tensor in (pinned) CPU memory; `stream` is the side stream that copied it, None when synchronous."""

    __slots__ = ("device", "host", "stream", "__weakref__")

    def __init__(self, device: torch.device, host: torch.Tensor, stream: torch.cuda.Stream | None):
        self.device, self.host, self.stream = device, host, stream


class _OnDisk:
    """A saved tensor spilled to its own file; the file goes when this handle does (autograd drops it after
    backward, or with the graph), never on unpack: backward may unpack one handle more than once."""

    __slots__ = ("path", "dtype", "shape", "device", "__weakref__")

    def __init__(self, path: str, dtype: torch.dtype, shape: torch.Size, device: torch.device):
        self.path, self.dtype, self.shape, self.device = path, dtype, shape, device
        weakref.finalize(self, _unlink, path)  # also runs at interpreter exit


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Reusable context manager (enter it around every forward). Counters cover all forwards so far."""

    def __init__(self, mode: str, model: torch.nn.Module, min_bytes: int, spill_dir: str | None):
        self.mode, self.model, self.min_bytes = mode, model, min_bytes
        self.spill_dir = spill_dir or tempfile.gettempdir()
        if mode == "disk":
            os.makedirs(self.spill_dir, exist_ok=True)
        self.bytes_offloaded = self.tensors_offloaded = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # Several ops save the very same tensor (q/k/v projections all save their input): offload it once.
        # Entries are weak both ways, so the cache keeps neither the activation nor its file alive.
        self._cache: dict[tuple[int, int], tuple[weakref.ref, weakref.ref]] = {}
        self._weights: set[int] = set()
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> ActivationOffload:
        # Re-read per forward: wrappers (DDP, FSDP, .to()) may have moved the weights since construction.
        self._weights = {t.untyped_storage().data_ptr() for t in (*self.model.parameters(), *self.model.buffers())}
        super().__enter__()
        return self

    def _keep(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        return (type(t) is not torch.Tensor  # parameters, and subclasses (DTensor, NF4) we cannot rebuild
                or t.layout != torch.strided or t.is_quantized or nbytes == 0 or nbytes < self.min_bytes
                or (t.is_leaf and t.requires_grad)  # inputs that want a gradient: autograd needs the original
                or t.untyped_storage().data_ptr() in self._weights  # weights (or views of them) are not activations
                or (self.mode == "cpu" and t.device.type == "cpu"))

    def _pack(self, t: torch.Tensor) -> Any:
        if self._keep(t):
            return t
        key = (id(t), t._version)
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is t and (handle := hit[1]()) is not None:
            return handle
        handle = self._spill(t) if self.mode == "disk" else self._to_host(t)
        self.bytes_offloaded += t.numel() * t.element_size()
        self.tensors_offloaded += 1
        cache = self._cache

        def forget(ref: weakref.ref) -> None:
            if (entry := cache.get(key)) is not None and entry[0] is ref:
                del cache[key]

        cache[key] = (weakref.ref(t, forget), weakref.ref(handle))
        return handle

    def _spill(self, t: torch.Tensor) -> _OnDisk:
        # Plain writes of the raw bytes (numpy has no bf16, so go through uint8): the pages end up in the
        # page cache, which the kernel can evict, instead of staying in this process's RSS.
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        fd, path = tempfile.mkstemp(prefix=f"memfit-act-{os.getpid()}-", suffix=".bin", dir=self.spill_dir)
        handle = _OnDisk(path, t.dtype, t.shape, t.device)  # owns the file from here on, even if the write fails
        with os.fdopen(fd, "wb") as f:
            raw.tofile(f)
        return handle

    def _to_host(self, t: torch.Tensor) -> _OnHost:
        if t.device.type != "cuda":  # another accelerator: synchronous copies, still correct
            return _OnHost(t.device, t.detach().to("cpu"), None)
        side = self._streams.get(t.device)
        if side is None:
            side = self._streams[t.device] = torch.cuda.Stream(t.device)
        # The copy runs on a side stream so the forward keeps computing while it drains; it must start after
        # the compute stream has produced t.
        side.wait_stream(torch.cuda.current_stream(t.device))
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(t.detach(), non_blocking=True)
        # Autograd drops t right after this hook; record_stream keeps the allocator from handing its memory to
        # a new tensor on the compute stream until the side stream's copy has read it.
        t.record_stream(side)
        return _OnHost(t.device, host, side)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _OnDisk):
            t = torch.from_numpy(np.fromfile(packed.path, dtype=np.uint8)).view(packed.dtype).reshape(packed.shape)
            return t.to(packed.device)
        if not isinstance(packed, _OnHost):
            return packed
        if packed.stream is None:
            return packed.host.to(packed.device)
        compute = torch.cuda.current_stream(packed.device)
        # Same side stream as the forward copy, so the host buffer is complete before it is read back.
        with torch.cuda.stream(packed.stream):
            t = packed.host.to(packed.device, non_blocking=True)
        compute.wait_stream(packed.stream)  # backward must not read t before it has arrived
        t.record_stream(compute)  # allocated on the side stream, used on compute: don't reuse it early
        return t


def offload_activations(mode: str | bool, device: torch.device, model: torch.nn.Module, *,
                        min_bytes: int = 1 << 20, spill_dir: str | None = None) -> contextlib.AbstractContextManager:
    """A context manager for the forward pass that offloads the tensors saved for backward.

    mode: "none" (or False) does nothing; "cpu" (or True) moves them to pinned CPU memory, overlapped on a
    side CUDA stream; "disk" spills them to files in spill_dir (default: the temp dir). Tensors under
    min_bytes, weights and buffers stay where they are. The returned object (except for "none") counts
    `bytes_offloaded` and `tensors_offloaded`.
    """
    if isinstance(mode, bool):
        mode = "cpu" if mode else "none"
    if mode == "none":
        return contextlib.nullcontext()
    if mode not in ("cpu", "disk"):
        raise UserError(f"offload_activations: {mode!r} is not one of none, cpu, disk")
    if mode == "cpu" and device.type == "cpu":
        raise UserError("offload_activations: true moves activations from the GPU to CPU memory; this run is on "
                        "the CPU: use offload_activations: disk to spill them to a file")
    return ActivationOffload(mode, model, min_bytes, spill_dir)


class _OffloadState(Mapping):
    """`optimizer.state` keyed by the device parameters: the inner AdamW's state of each one's master plus the
    master itself, so a memory report summing these tensors sees all the CPU memory the optimizer holds, and
    `new.state[p] = old.state[p]` (a stage switch carrying state over) carries the fp32 master too."""

    def __init__(self, opt: CPUOffloadAdamW):
        self._opt = opt

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        master = self._opt._masters[p]
        return {**self._opt.inner.state.get(master, {}), "master": master}

    def __setitem__(self, p: torch.Tensor, value: dict[str, Any]) -> None:
        master = self._opt._masters[p]
        value = dict(value)
        self._opt._wait()
        if (saved := value.pop("master", None)) is not None:
            master.copy_(saved)
        # State from a plain AdamW may be on the device and in the parameter's dtype: bring it to the master's.
        self._opt.inner.state[master] = {k: v.to(master.device, torch.float32) if torch.is_tensor(v) else v
                                         for k, v in value.items()}

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._opt._masters)

    def __len__(self) -> int:
        return len(self._opt._masters)


class CPUOffloadAdamW(torch.optim.Optimizer):
    """AdamW whose fp32 master weights and moments live in CPU memory (ZeRO-Offload for one device).

    Its param_groups hold the *device* parameters, so everything that works on an optimizer's groups keeps
    working on the model's weights and gradients: LR schedulers (they also require a torch Optimizer),
    GradScaler.unscale_, clip_grad_norm_, zero_grad. A plain torch AdamW (`inner`) over the CPU masters
    does the update; step() copies gradients in, steps, and copies the weights back in the device's dtype.
    Build it after the model's weights are final: the masters start as copies of them.
    """

    inner: torch.optim.AdamW  # over the masters; created with the first group

    def __init__(self, param_groups: list[dict[str, Any]], lr: float, betas: tuple[float, float],
                 weight_decay: float = 0.0, eps: float = 1e-8, *, fused: bool = True):
        self._masters: dict[torch.Tensor, torch.Tensor] = {}
        self._stage: dict[torch.Tensor, torch.Tensor] = {}  # pinned transfer buffers, in the param's dtype
        self._grad: dict[torch.Tensor, torch.Tensor] = {}  # fp32 gradient buffers of the masters
        self._pending: list[torch.cuda.Event] = []
        self._fused = fused  # one vectorised pass per tensor on the CPU, torch's nearest to DeepSpeed's CPU Adam
        super().__init__(param_groups, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))
        self.state = _OffloadState(self)  # type: ignore[assignment]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            # Pin only what a non-blocking copy touches (pinned pages cannot be swapped): the master and its
            # gradient for fp32 parameters, else a staging buffer in the parameter's dtype, because copy_
            # across devices with a dtype change goes through an unpinned temporary and blocks.
            pin = p.is_cuda and p.dtype == torch.float32
            self._masters[p] = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin).copy_(p.detach())
            self._grad[p] = torch.zeros(p.shape, dtype=torch.float32, pin_memory=pin)
            if p.is_cuda and not pin:
                self._stage[p] = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
        inner_group = {**group, "params": [self._masters[p] for p in group["params"]]}
        if "inner" not in self.__dict__:
            self.inner = torch.optim.AdamW([inner_group], lr=group["lr"], fused=self._fused)
        else:
            self.inner.add_param_group(inner_group)

    def _wait(self) -> None:
        """Block until the last step's host-to-device copies have read the masters and staging buffers."""
        for event in self._pending:
            event.synchronize()
        self._pending.clear()

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        with torch.enable_grad():
            loss = None if closure is None else closure()
        self._wait()
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            # Schedulers and users set hyperparameters on our groups; the inner AdamW reads its own.
            inner_group.update({k: group[k] for k in ("lr", "betas", "weight_decay", "eps")})
        with_grad = [p for p in self._params() if p.grad is not None]
        for p in self._params():
            self._masters[p].grad = None if p.grad is None else self._grad[p]  # AdamW skips p without a grad
        for p in with_grad:
            self._stage.get(p, self._grad[p]).copy_(p.grad, non_blocking=p.is_cuda)
        devices = {p.device for p in with_grad if p.is_cuda}
        for device in devices:  # the gradients must have landed before the CPU reads them
            torch.cuda.current_stream(device).synchronize()
        for p in with_grad:
            if p in self._stage:
                self._grad[p].copy_(self._stage[p])
        self.inner.step()
        for p in with_grad:
            src = self._stage[p].copy_(self._masters[p]) if p in self._stage else self._masters[p]
            p.copy_(src, non_blocking=p.is_cuda)
        # Those copies still read src; the next CPU write to it (step, load) waits for this event first.
        self._pending = [torch.cuda.current_stream(device).record_event() for device in devices]
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's layout, indexed over the groups' parameters in order; each entry also has "master" (fp32)
        when the device parameter is not fp32 (an fp32 parameter equals its master, so it is rebuilt from it)."""
        self._wait()
        sd = self.inner.state_dict()
        state = {i: dict(sd["state"].get(i, {})) for i in range(len(self._params()))}
        for i, p in enumerate(self._params()):
            if p.dtype != torch.float32:
                state[i]["master"] = self._masters[p]  # a live reference, like the moments
        groups = [{**inner_g, **{k: v for k, v in g.items() if k != "params"}}
                  for g, inner_g in zip(self.param_groups, sd["param_groups"], strict=True)]
        return {"state": {i: s for i, s in state.items() if s}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._wait()
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("loaded state dict's parameter groups do not match this optimizer's")
        entries = {int(i): dict(entry) for i, entry in state_dict["state"].items()}
        masters = {i: entry.pop("master") for i, entry in entries.items() if "master" in entry}
        inner_state = {i: entry for i, entry in entries.items() if entry}
        self.inner.load_state_dict({"state": inner_state, "param_groups": saved_groups})
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        with torch.no_grad():
            for i, p in enumerate(self._params()):
                if i in masters:  # the master is the truth, the device weight its cast
                    p.copy_(self._masters[p].copy_(masters[i]))
                else:
                    self._masters[p].copy_(p)
