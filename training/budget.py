"""`checkpointing: auto`: checkpoint just enough decoder layers to fit activations into `activation_budget` bytes.

Checkpointing every layer is the usual all-or-nothing switch, but it pays one extra forward of every layer in the
backward even when checkpointing half of them would already fit. So we measure, in one probe forward, the bytes each
layer saves for backward and the bytes it would keep if checkpointed (its input hidden state, which non-reentrant
checkpointing saves), then pick the layers with the least recompute time whose predicted activation memory fits.
Bytes are counted the way training.memory.ActivationMeter counts them (distinct storages saved for backward,
parameters excluded), so the meter can check the prediction after the plan is applied.
"""

from __future__ import annotations

import math
import statistics
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from transformers.modeling_layers import GradientCheckpointingLayer

from memfit.errors import UserError
from training.model import base_model

OTHER = -1  # saved outside every decoder layer: embeddings, final norm, logits, loss
SHARED = -2  # saved by more than one owner: checkpointing any single layer does not free it
MAX_STATES = 4096  # cap on the knapsack frontier; see _pareto


def find_decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers: the nn.ModuleList with config.num_hidden_layers members."""
    base = base_model(model)
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    lists = [m for _, m in base.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    # A model may hold other per-layer lists (norms, adapters); the checkpointable blocks are the decoder layers.
    for candidate in lists:
        if all(isinstance(layer, GradientCheckpointingLayer) for layer in candidate):
            return candidate
    if lists:
        return lists[0]
    raise UserError(f"checkpointing: auto: cannot find the decoder layers of {type(base).__name__} "
                    f"(no nn.ModuleList of config.num_hidden_layers={n} modules)")


@dataclass
class LayerCost:
    index: int
    saved_bytes: int  # saved for backward by this layer's forward, not checkpointed (MLP part included)
    boundary_bytes: int  # kept when the whole layer is checkpointed: the layer's input hidden state
    forward_s: float  # the layer's forward time (what checkpointing it adds to the backward); see probe_layers
    # The MLP-only option; mlp_forward_s is None when the layer has no `mlp` submodule (then no such option).
    mlp_saved_bytes: int = 0  # part of saved_bytes that checkpointing just the MLP frees
    mlp_boundary_bytes: int = 0  # what a checkpointed MLP adds back: its input, unless the layer keeps it anyway
    mlp_forward_s: float | None = None

    def options(self) -> list[tuple[int, float, str]]:
        """(bytes kept, recompute seconds, kind) for each way to run this layer; useless options left out."""
        opts = [(self.saved_bytes, 0.0, "none")]
        if self.mlp_forward_s is not None and self.mlp_boundary_bytes < self.mlp_saved_bytes:
            opts.append((self.saved_bytes - self.mlp_saved_bytes + self.mlp_boundary_bytes, self.mlp_forward_s, "mlp"))
        if self.boundary_bytes < self.saved_bytes:
            opts.append((self.boundary_bytes, self.forward_s, "full"))
        return opts


def _mlp(layer: torch.nn.Module) -> torch.nn.Module | None:
    mlp = getattr(layer, "mlp", None)
    return mlp if isinstance(mlp, torch.nn.Module) else None


def probe_layers(model: torch.nn.Module, run_forward: Callable[[], torch.Tensor]) -> tuple[list[LayerCost], int]:
    """One un-checkpointed forward with per-layer accounting; returns the layer costs and the bytes outside layers.

    run_forward runs the model and loss on a real micro-batch (under the training autocast) and returns the loss.
    Under DDP call it inside no_sync() or on the unwrapped model: the probe runs no backward.
    """
    layers = find_decoder_layers(model)
    n = len(layers)
    mlps = [_mlp(layer) for layer in layers]
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    # An owner is (layer, in_mlp) or one of (OTHER, False), (SHARED, False).
    totals: dict[tuple[int, bool], int] = {}
    # data_ptr -> (weak ref, owner, bytes). Nothing is kept for backward (see pack), so a freed storage's address
    # can come back for a new tensor; the weak ref tells a live storage (same one) from a reused address (new one).
    owners: dict[int, tuple[StorageWeakRef, tuple[int, bool], int]] = {}
    current = [(OTHER, False)]
    boundary, mlp_boundary = [0] * n, [0] * n
    seconds, mlp_seconds = [0.0] * n, [0.0] * n
    started, mlp_started = [0.0] * n, [0.0] * n
    mlp_input: list[torch.Tensor | None] = [None] * n

    def pack(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in param_ptrs or nbytes == 0:
            return None
        seen, now = owners.get(ptr), current[0]
        if seen is None or seen[0].expired():
            owners[ptr] = (StorageWeakRef(storage), now, nbytes)
            totals[now] = totals.get(now, 0) + nbytes
        elif seen[1] not in (now, (SHARED, False)):
            if seen[1][0] == now[0] >= 0:
                # Saved inside and outside the MLP of one layer (say by the MLP and a norm): checkpointing the MLP
                # keeps it, checkpointing the whole layer frees it, so it belongs to the layer's non-MLP part.
                to = (now[0], False)
            else:
                # Saved by two layers (the RoPE cos/sin that every layer saves) or by a layer and outside it. No
                # single layer's checkpointing frees it (checkpointed layers still hold it through the recompute
                # closure, the others save it), so it belongs with other_bytes, never to a layer.
                to = (SHARED, False)
            totals[seen[1]] -= nbytes
            totals[to] = totals.get(to, 0) + nbytes
            owners[ptr] = (seen[0], to, nbytes)
        # Keep nothing: there is no backward, so the probe peaks like inference rather than like the
        # un-checkpointed training step that the budget exists to avoid.
        return None

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("the activation probe's graph is not for backward")

    def sync(t: object) -> None:
        # CUDA runs asynchronously: without a sync the clock measures kernel launches, not the layer.
        if isinstance(t, torch.Tensor) and t.is_cuda:
            torch.cuda.synchronize(t.device)

    def first(args: tuple, kwargs: dict) -> torch.Tensor | None:
        hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
        return hidden if isinstance(hidden, torch.Tensor) else None

    def before(i: int):
        def hook(_module, args, kwargs):
            if (hidden := first(args, kwargs)) is not None:
                # Non-reentrant checkpoint saves its positional tensor inputs (the hidden state) through the same
                # saved-tensor hooks; the kwargs (mask, cos/sin) ride along in the recompute closure instead.
                boundary[i] = hidden.untyped_storage().nbytes()
                sync(hidden)
            current[0], started[i] = (i, False), time.perf_counter()
        return hook

    def after(i: int):
        def hook(_module, _args, output):
            sync(output[0] if isinstance(output, tuple) else output)
            seconds[i] += time.perf_counter() - started[i]
            current[0] = (OTHER, False)
            if (x := mlp_input[i]) is not None:
                # A checkpointed MLP saves its input. That adds bytes only if nothing but the MLP saved that storage
                # (then it is in mlp_saved, freed and saved again) or nothing saved it at all; a storage the rest of
                # the layer (a norm, the residual path) or another owner saves stays either way. Resolved here, at
                # the layer's end, so saves after the MLP count too; holding x keeps its address from being reused.
                seen = owners.get(x.untyped_storage().data_ptr())
                owner = None if seen is None or seen[0].expired() else seen[1]
                mlp_boundary[i] = x.untyped_storage().nbytes() if owner in (None, (i, True)) else 0
                mlp_input[i] = None
        return hook

    def mlp_before(i: int):
        def hook(_module, args, kwargs):
            if (x := first(args, kwargs)) is not None:
                mlp_input[i] = x
                sync(x)
            current[0], mlp_started[i] = (i, True), time.perf_counter()
        return hook

    def mlp_after(i: int):
        def hook(_module, _args, output):
            sync(output[0] if isinstance(output, tuple) else output)
            mlp_seconds[i] += time.perf_counter() - mlp_started[i]
            current[0] = (i, False)
        return hook

    flags = [getattr(layer, "gradient_checkpointing", None) for layer in layers]
    wrapped = [mlp is not None and _unwrap_mlp(mlp) for mlp in mlps]  # measure MLPs un-checkpointed too
    handles = []
    try:
        for i, (layer, mlp) in enumerate(zip(layers, mlps, strict=True)):
            if flags[i] is not None:
                layer.gradient_checkpointing = False  # measure what each layer saves when it is not checkpointed
            handles.append(layer.register_forward_pre_hook(before(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(after(i)))
            if mlp is not None:
                handles.append(mlp.register_forward_pre_hook(mlp_before(i), with_kwargs=True))
                handles.append(mlp.register_forward_hook(mlp_after(i)))
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            run_forward()
    finally:
        for handle in handles:
            handle.remove()
        for layer, mlp, flag, wrap in zip(layers, mlps, flags, wrapped, strict=True):
            if flag is not None:
                layer.gradient_checkpointing = flag
            if wrap:
                _wrap_mlp(mlp)
    # One forward's per-layer clock is noisy (the first layer pays warm-up, other processes steal the CPU), but
    # layers that save the same bytes do the same work: give each the median time of its group.
    keys = [(totals.get((i, False), 0) + totals.get((i, True), 0), boundary[i], totals.get((i, True), 0),
             mlp_boundary[i], mlps[i] is not None) for i in range(n)]
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    costs = []
    for i, (saved, bound, mlp_saved, mlp_bound, has_mlp) in enumerate(keys):
        group = groups[keys[i]]
        costs.append(LayerCost(i, saved, bound, statistics.median(seconds[j] for j in group), mlp_saved, mlp_bound,
                               statistics.median(mlp_seconds[j] for j in group) if has_mlp else None))
    return costs, totals.get((OTHER, False), 0) + totals.get((SHARED, False), 0)


@dataclass
class CheckpointPlan:
    layers: list[int]  # decoder layers to checkpoint whole
    predicted_bytes: int
    budget: int
    recompute_s: float
    min_bytes: int  # the least any plan keeps (layers checkpointed whole where that saves bytes)
    max_bytes: int  # nothing checkpointed
    costs: list[LayerCost] = field(default_factory=list)
    other_bytes: int = 0
    mlp_layers: list[int] = field(default_factory=list)  # layers whose MLP alone is checkpointed; not in layers

    def table(self) -> str:
        rows = [f"{'layer':>5}  {'saved':>10}  {'kept if ckpt':>12}  {'mlp frees':>10}  {'ckpt':>4}  {'recompute':>9}"]
        for c in self.costs:
            kind, t = ("full", c.forward_s) if c.index in self.layers else \
                ("mlp", c.mlp_forward_s or 0.0) if c.index in self.mlp_layers else ("none", 0.0)
            frees = "-" if c.mlp_forward_s is None else _mib(c.mlp_saved_bytes - c.mlp_boundary_bytes)
            rows.append(f"{c.index:>5}  {_mib(c.saved_bytes):>10}  {_mib(c.boundary_bytes):>12}  {frees:>10}  "
                        f"{kind:>4}  {f'{t * 1e3:.1f}ms' if kind != 'none' else '-':>9}")
        rows += [f"outside layers (embeddings, norm, logits, loss, shared): {_mib(self.other_bytes)}",
                 f"predicted activations {_mib(self.predicted_bytes)} <= budget {_mib(self.budget)} "
                 f"(range {_mib(self.min_bytes)} all checkpointed .. {_mib(self.max_bytes)} none); "
                 f"{len(self.layers)}/{len(self.costs)} layers checkpointed, {len(self.mlp_layers)} MLPs only, "
                 f"recompute {self.recompute_s * 1e3:.1f}ms per micro-batch"]
        return "\n".join(rows)


def choose_checkpointing(costs: list[LayerCost], other_bytes: int, budget: int) -> CheckpointPlan:
    """Per layer none / MLP only / whole, with the least recompute time such that predicted activations <= budget."""
    options = [c.options() for c in costs]
    max_bytes = other_bytes + sum(c.saved_bytes for c in costs)
    # An option that keeps at least as much as not checkpointing is left out (LayerCost.options), so the floor
    # leaves a layer alone whose input outweighs what it saves.
    floors = [min(b for b, _, _ in opts) for opts in options]
    min_bytes = other_bytes + sum(floors)
    if budget < min_bytes:
        raise UserError(
            f"activation_budget: {budget} ({_mib(budget)}) cannot be met: the smallest activation memory for this "
            f"recipe is {min_bytes} ({_mib(min_bytes)}, every layer checkpointed); raise activation_budget to at "
            f"least {_round_up(min_bytes)} or lower batch_size/block_size")
    if budget >= max_bytes:
        return CheckpointPlan([], max_bytes, budget, 0.0, min_bytes, max_bytes, list(costs), other_bytes)
    # A multiple-choice knapsack: each layer picks one option, minimising recompute time with bytes <= budget. Solved
    # exactly on the Pareto frontier of (bytes, time) states after each layer: layers are near-identical, so the
    # frontier stays small (about (n+1)(n+2)/2 states for n equal layers), exact unlike greedy by bytes per second
    # when sizes differ, and unlike a DP over bytes rounded to a grain, which can break the budget or miss the
    # optimum. States carry exact bytes, so the budget always holds. A state is dropped once even the floor of the
    # layers still to come would overrun the budget.
    rest = sum(floors)
    frontier: list[tuple[int, float, tuple]] = [(other_bytes, 0.0, ())]  # (bytes, recompute, chain of option kinds)
    for opts, floor in zip(options, floors, strict=True):
        rest -= floor
        grown = [(w + b, v + t, (chain, kind)) for w, v, chain in frontier for b, t, kind in opts
                 if w + b + rest <= budget]
        frontier = _pareto(grown, budget - min_bytes + 1)
    predicted, recompute, chain = min(frontier, key=lambda s: (s[1], s[0]))
    kinds: list[str] = []
    while chain:
        chain, kind = chain
        kinds.append(kind)
    kinds.reverse()
    layers = [c.index for c, k in zip(costs, kinds, strict=True) if k == "full"]
    mlp_layers = [c.index for c, k in zip(costs, kinds, strict=True) if k == "mlp"]
    return CheckpointPlan(layers, predicted, budget, recompute, min_bytes, max_bytes, list(costs), other_bytes,
                          mlp_layers)


def _pareto(states: list[tuple[int, float, tuple]], span: int) -> list[tuple[int, float, tuple]]:
    """States not beaten by one at most as heavy with at most as much recompute, sorted by bytes."""
    front: list[tuple[int, float, tuple]] = []
    for s in sorted(states, key=lambda s: (s[0], s[1])):
        if not front or s[1] < front[-1][1]:
            front.append(s)
    if len(front) > MAX_STATES:
        # Only for many layers with very unequal sizes: keep the best state per bytes bucket. This can lose a little
        # optimality but never feasibility, since each state keeps its exact bytes.
        best: dict[int, tuple[int, float, tuple]] = {}
        low = front[0][0]
        for s in front:
            best[(s[0] - low) * MAX_STATES // span] = s  # the frontier's last state in a bucket has the least time
        front = sorted(best.values(), key=lambda s: (s[0], s[1]))
    return front


def _checkpointed_mlp_forward(self: torch.nn.Module, *args, **kwargs):
    """Bound to an MLP as its forward: its own forward under non-reentrant checkpointing while training."""
    inner = self._memfit_inner_forward or type(self).forward.__get__(self)
    if torch.is_grad_enabled() and self.training:
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)
    return inner(*args, **kwargs)


def _is_wrapped(mlp: torch.nn.Module) -> bool:
    forward = mlp.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _checkpointed_mlp_forward


def _wrap_mlp(mlp: torch.nn.Module) -> None:
    if _is_wrapped(mlp):  # idempotent
        return
    # The instance's own forward, if any (accelerate's hooks set one; None: the class's), so _unwrap_mlp restores
    # exactly that. A bound method, not a closure, so copy.deepcopy(model) rebinds it to the copy's MLP.
    mlp._memfit_inner_forward = mlp.__dict__.get("forward")
    mlp.forward = types.MethodType(_checkpointed_mlp_forward, mlp)  # nn.Module.__call__ looks it up per call


def _unwrap_mlp(mlp: torch.nn.Module) -> bool:
    """Remove the MLP checkpoint wrap; whether there was one."""
    if not _is_wrapped(mlp):
        return False
    inner = mlp.__dict__.pop("_memfit_inner_forward")
    if inner is None:
        del mlp.forward
    else:
        mlp.forward = inner
    return True


def apply_checkpointing(model: torch.nn.Module, layers: list[int], mlp_layers: Iterable[int] = ()) -> None:
    """Non-reentrant checkpointing on exactly these decoder layers, and on just the MLP of the mlp_layers."""
    decoder = find_decoder_layers(model)
    chosen, mlp_chosen = set(layers), set(mlp_layers)
    if not chosen | mlp_chosen <= set(range(len(decoder))):
        raise ValueError(f"layers {sorted(chosen | mlp_chosen)} out of range for {len(decoder)} decoder layers")
    if chosen & mlp_chosen:
        raise ValueError(f"layers {sorted(chosen & mlp_chosen)} are both checkpointed whole and MLP only")
    if chosen and not all(isinstance(layer, GradientCheckpointingLayer) for layer in decoder):
        raise UserError(f"checkpointing: auto: {type(base_model(model)).__name__}'s layers cannot be checkpointed "
                        "one by one; use checkpointing: full")
    if missing := sorted(i for i in mlp_chosen if _mlp(decoder[i]) is None):
        raise ValueError(f"layers {missing} have no mlp submodule to checkpoint")
    if chosen:
        # transformers sets each layer's checkpoint function and makes the embeddings' output require grad (so a
        # frozen base under LoRA still has a graph through the checkpoint); then we switch off the unchosen layers,
        # which the layer's forward reads on every call.
        base_model(model).activation_checkpointing_enable({"use_reentrant": False})
    # MLP-only needs no such hook: non-reentrant checkpointing keeps the graph to the MLP's own parameters even
    # when its input does not require grad.
    for i, layer in enumerate(decoder):
        if isinstance(layer, GradientCheckpointingLayer):
            layer.gradient_checkpointing = i in chosen
        if (mlp := _mlp(layer)) is not None:
            _unwrap_mlp(mlp)  # undo a previous plan first, so a plan never stacks on an old one
            if i in mlp_chosen:
                _wrap_mlp(mlp)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _round_up(n: int) -> str:
    """n rounded up to a size a user would write (and memfit.sizes.parse_size reads): whole MiB, or tenths of a GiB."""
    if n < 2**30:
        return f"{math.ceil(n / 2**20)}MiB"
    return f"{math.ceil(n * 10 / 2**30) / 10:.1f}GiB"
