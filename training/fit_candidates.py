"""The candidates `memfit fit --for train` weighs, and each one's predicted memory, derived from a few probes.

A probe (training.fit_child probe: one fresh process per method and precision) measures, at the smallest and the
largest micro-batch and for each loss kind, the plan's parts and the bytes every decoder layer saves for backward.
Every other candidate's MemoryPlan is then computed with the plan's own code (training.plan, training.budget):

- base, parameters, gradients, embedding gradient: the probe's plan (base from its first point: a fresh process;
  for adamw8bit plus the bytes the probe measured importing bitsandbytes costs).
- optimizer state and step temporaries: training.plan.optimizer_bytes / optimizer_temp_bytes over the probe's
  list of trainable tensor sizes (exact counts for adamw, adamw8bit, optimizer_offload; AdamW8bit's temporaries
  per element as the probe measured them on this device).
- loss transient: training.plan.loss_bytes for the micro-batch's tokens and the probed vocabulary.
- activations: each layer's saved / checkpointed bytes and the bytes outside the layers are affine in the
  micro-batch (measured: every saved tensor has a batch dimension, lm_head's gradient under the chunked loss
  does not), so they are interpolated between the two probed micro-batches (exact at both; one probed point:
  proportional). checkpointing none / full sum them as plan_checkpointing does; auto runs
  training.budget.choose_checkpointing on them with activation_budget = what the memory budget leaves for
  activations; offloaded activations count 0, as in the plan.

The predicted peak is max(MemoryPlan's peak, its peak_first_step, the probe's own peak while loading): the
verification run measures the whole process, loading included. A candidate is predicted to fit when that is at most
(1 - MARGIN) x budget. The expected-speed score orders which candidates get verified by a real run; it is a
heuristic (see speed_score), and the choice among verified candidates is by measured tokens/s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from training.budget import LayerCost, choose_checkpointing
from training.config import TrainConfig
from training.plan import MemoryPlan, loss_bytes, optimizer_bytes, optimizer_temp_bytes

MARGIN = 0.05
"""Safety margin: a candidate is predicted to fit when its predicted peak is <= (1 - MARGIN) x budget. It absorbs
what the plan's counts cannot see: run-to-run RSS noise (a few MiB) and heap fragments of sub-MiB tensors, which
put the shipped model's LoRA at micro-batch 1 ~4.5% above its plan. Misses beyond it are caught by verification."""
RECOMPUTE_COST = 1 / 3
"""Step time added per unit of the layers' forward time that is recomputed (a forward is ~1/3 of a step)."""
SLOWDOWN = {"offload_disk": 2.0, "offload_cpu": 1.3, "optimizer_offload": 1.4, "adamw8bit_cpu": 1.1,
            "micro_batch_halved": 0.05, "low_precision_cuda": 0.6}
"""Heuristic step-time factors used only to order candidates for verification (never to choose)."""


@dataclass
class Probe:
    """What one probe process measured for one method and precision."""

    method: str
    """full, lora or qlora."""
    precision: str
    """fp32, bf16 or fp16 (resolved)."""
    device: str
    """cpu or cuda."""
    vocab: int
    """Rows of lm_head: the loss's width."""
    trainable: list[tuple[int, str]]
    """(numel, dtype) of every trainable tensor: the optimizer's state is counted from these."""
    points: list[dict[str, Any]]
    """Per probed (loss, micro-batch): the plan, the per-layer costs and the bytes outside the layers."""
    adamw8bit: bool = False
    """Whether bitsandbytes' AdamW8bit steps on this device."""
    load_peak: int = 0
    """The probe process's peak after loading, before any probe forward (VmHWM on CPU, max allocated on CUDA):
    a floor under every candidate's peak (tokenizing a large corpus can top the training step)."""
    adamw8bit_bytes: int = 0
    """What importing bitsandbytes and stepping AdamW8bit once added to the probe process: base of adamw8bit."""
    adamw8bit_temp: float = 0.0
    """Bytes per element that AdamW8bit's step held beyond its state (CPU: fp32 copies of both moments and more),
    for the largest trainable tensor: its step temporaries."""
    hidden: int = 0
    """Columns of lm_head: the width of its compute-dtype copy in the chunked loss."""

    @property
    def first(self) -> dict[str, Any]:
        return self.points[0]["plan"]


@dataclass
class Candidate:
    """One way to run the recipe, its predicted plan and, once verified, what a real run measured."""

    method: str
    """full, lora or qlora: what trains."""
    precision: str
    """fp32, bf16 or fp16."""
    batch_size: int
    """Micro-batch (sequences)."""
    grad_accum: int
    """Micro-batches per step: global batch / batch_size."""
    checkpointing: str
    """none, auto or full."""
    activation_budget: int | None
    """With checkpointing auto: the bytes activations may keep (what the budget leaves them)."""
    loss: str
    """chunked or plain."""
    offload_activations: str
    """none, disk (CPU) or cpu (CUDA)."""
    optimizer: str
    """adamw or adamw8bit."""
    optimizer_offload: str
    """none or cpu (CUDA only)."""
    plan: dict[str, Any] = field(default_factory=dict)
    """The derived MemoryPlan (as_dict), see the module docstring."""
    predicted_peak: int = 0
    """max(plan peak, plan peak_first_step): bytes."""
    score: float = 0.0
    """Expected relative step time (lower is faster): the verification order, not the choice."""
    measured_peak: int | None = None
    """Peak of the verification run's process (VmHWM on CPU, max_memory_allocated on CUDA): bytes."""
    measured_tok_s: float | None = None
    """Tokens/s over the verification run's steps after the first (median of its runs)."""
    runs_tok_s: list[float] = field(default_factory=list)
    """Each verification run's tok/s, in order (more than one when it was confirmed against a near tie)."""
    status: str = "not verified"
    """chosen, fits, over budget, failed, not verified or predicted over budget."""
    note: str = ""
    """Why a verification failed, or how the prediction was made when not from two probed points."""

    def overrides(self) -> dict[str, Any]:
        """The recipe keys this candidate sets."""
        return {"lora": self.method in ("lora", "qlora"), "qlora": self.method == "qlora",
                "precision": self.precision, "batch_size": self.batch_size, "grad_accum": self.grad_accum,
                "checkpointing": self.checkpointing,
                "activation_budget": f"{self.activation_budget // 2**20}MiB" if self.activation_budget else None,
                "loss": self.loss, "offload_activations": self.offload_activations, "optimizer": self.optimizer,
                "optimizer_offload": self.optimizer_offload}

    def label(self) -> str:
        ckpt = self.checkpointing + (f"({self.activation_budget / 2**20:.0f}MiB)" if self.activation_budget else "")
        extra = [f"offload {self.offload_activations}"] * (self.offload_activations != "none") + \
            [f"optimizer_offload {self.optimizer_offload}"] * (self.optimizer_offload != "none")
        return " ".join([self.method, self.precision, f"{self.batch_size}x{self.grad_accum}", f"ckpt {ckpt}",
                         self.loss, self.optimizer, *extra])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _interp(points: list[tuple[int, float]], b: int) -> float:
    """Affine through the smallest and largest probed micro-batch; proportional with one point."""
    (b0, v0), (b1, v1) = min(points), max(points)
    if b0 == b1:
        return v0 * b / b0
    return v0 + (v1 - v0) * (b - b0) / (b1 - b0)


def costs_at(probe: Probe, batch: int) -> list[LayerCost]:
    """Per-layer costs at this micro-batch (layer bytes do not depend on the loss: every point counts)."""
    n = len(probe.points[0]["costs"])
    out = []
    for i in range(n):
        values = {}
        for key in ("saved_bytes", "boundary_bytes", "forward_s", "mlp_saved_bytes", "mlp_boundary_bytes"):
            pts = [(p["batch_size"], p["costs"][i][key]) for p in probe.points]
            v = _interp(pts, batch)
            values[key] = v if key == "forward_s" else round(v)
        mlp_s = probe.points[0]["costs"][i]["mlp_forward_s"]
        if mlp_s is not None:
            mlp_s = _interp([(p["batch_size"], p["costs"][i]["mlp_forward_s"]) for p in probe.points], batch)
        out.append(LayerCost(i, mlp_forward_s=mlp_s, **values))
    return out


def other_at(probe: Probe, loss: str, batch: int) -> int:
    """Bytes saved outside the decoder layers (embeddings, final norm, the loss's own) for this loss kind."""
    pts = [(p["batch_size"], p["other"]) for p in probe.points if p["loss"] == loss]
    return round(_interp(pts, batch))


def derive(probe: Probe, cand: Candidate, cfg: TrainConfig, limit: int) -> bool:
    """Fill cand.plan, predicted_peak and score (and, for checkpointing auto, activation_budget). False when
    the candidate is no candidate: checkpointing auto whose budget is infeasible or the same as none."""
    b = cand.batch_size
    costs, other = costs_at(probe, b), other_at(probe, cand.loss, b)
    settings = dataclasses.replace(cfg, batch_size=b, loss=cand.loss, optimizer=cand.optimizer,
                                   optimizer_offload=cand.optimizer_offload)
    device = torch.device(probe.device)
    trainable = [torch.empty(n, dtype=getattr(torch, dt), device="meta") for n, dt in probe.trainable]
    first = probe.first
    base = first["base"] + (probe.adamw8bit_bytes if cand.optimizer == "adamw8bit" else 0)
    plan = MemoryPlan(base=base, parameters=first["parameters"], gradients=first["gradients"],
                      optimizer_state=optimizer_bytes(settings, trainable),
                      optimizer_on_device=cand.optimizer_offload == "none", activations=0,
                      loss=loss_bytes(settings, b * cfg.block_size, probe.vocab, cand.precision != "fp32",
                                      probe.hidden),
                      recompute=0, embedding_grad=first["embedding_grad"],
                      embedding_tied=first["embedding_tied"],
                      optimizer_temp=optimizer_temp_bytes(settings, trainable, device, probe.adamw8bit_temp),
                      accumulating=cand.grad_accum > 1)
    chosen: list[int] = [c.index for c in costs] if cand.checkpointing == "full" else []
    mlp: list[int] = []
    plan.activations = other + sum(c.boundary_bytes if c.index in chosen else c.saved_bytes for c in costs)
    if cand.checkpointing == "auto":
        # what the budget leaves activations (and, accumulating, the gradients held beside them)
        room = limit - plan.base - plan.device_optimizer - plan.loss - (plan.gradients if plan.accumulating else 0)
        cand.activation_budget = max(room, 0) // 2**20 * 2**20  # written as whole MiB
        floor = other + sum(min(kept for kept, _, _ in c.options()) for c in costs)
        if not floor <= cand.activation_budget < plan.activations:
            return False
        choice = choose_checkpointing(costs, other, cand.activation_budget)
        chosen, mlp, plan.activations = choice.layers, choice.mlp_layers, choice.predicted_bytes
    if cand.offload_activations != "none":
        plan.activations = 0
    plan.recompute = max([c.saved_bytes for c in costs if c.index in chosen]
                         + [c.mlp_saved_bytes for c in costs if c.index in mlp], default=0)
    cand.plan = plan.as_dict()
    cand.predicted_peak = max(plan.peak, plan.peak_first_step, probe.load_peak)
    total = sum(c.forward_s for c in costs) or 1.0
    recomputed = sum(c.forward_s for c in costs if c.index in chosen) + \
        sum(c.mlp_forward_s or 0.0 for c in costs if c.index in mlp)
    cand.score = speed_score(cand, recomputed / total, cand.batch_size * cand.grad_accum, probe.device == "cuda")
    return True


def speed_score(cand: Candidate, recompute_fraction: float, max_batch: int, cuda: bool) -> float:
    """Expected step time relative to the plainest plan: recompute adds RECOMPUTE_COST x the layers' forward
    time it repeats (measured per layer by the probe); the other factors (SLOWDOWN) are rough."""
    s = 1.0 + RECOMPUTE_COST * recompute_fraction
    s *= 1.0 + SLOWDOWN["micro_batch_halved"] * math.log2(max_batch / cand.batch_size)
    if cand.offload_activations == "disk":
        s *= SLOWDOWN["offload_disk"]
    elif cand.offload_activations == "cpu":
        s *= SLOWDOWN["offload_cpu"]
    if cand.optimizer_offload != "none":
        s *= SLOWDOWN["optimizer_offload"]
    if cand.optimizer == "adamw8bit" and not cuda:
        s *= SLOWDOWN["adamw8bit_cpu"]
    if cand.precision != "fp32" and cuda:
        s *= SLOWDOWN["low_precision_cuda"]
    return s


def enumerate_candidates(probe: Probe, cfg: TrainConfig, limit: int, optimizers: list[str]) -> list[Candidate]:
    """Every combination worth a row: micro-batch x loss x optimizer (x optimizer offload on CUDA) x
    {no checkpointing, auto (only where it differs from none and full), full, activations offloaded}."""
    global_batch = cfg.batch_size * cfg.grad_accum
    cuda = probe.device == "cuda"
    losses = [cfg.loss] + [k for k in ("chunked", "plain") if k != cfg.loss]
    out: list[Candidate] = []
    for loss in losses:
        probed = sorted({p["batch_size"] for p in probe.points if p["loss"] == loss})
        if not probed:
            continue  # not probed: its logits alone exceed the budget (see training.fit.probe_points)
        for b in sorted(divisors(global_batch), reverse=True):
            for opt in optimizers:
                for opt_off in ["none"] + (["cpu"] if cuda and opt == "adamw" else []):
                    for ckpt, off in (("none", "none"), ("auto", "none"), ("full", "none"),
                                      ("none", "cpu" if cuda else "disk")):
                        cand = Candidate(probe.method, probe.precision, b, global_batch // b, ckpt, None, loss, off,
                                         opt, opt_off)
                        if not derive(probe, cand, cfg, limit):
                            continue
                        if len(probed) == 1 and b != probed[0]:
                            cand.note = f"outside-layer bytes scaled from micro-batch {probed[0]} alone"
                        elif b > probed[-1]:
                            cand.note = f"extrapolated beyond the probed micro-batch {probed[-1]}"
                        out.append(cand)
    return out


def rank(cands: list[Candidate], recipe_loss: str) -> list[Candidate]:
    """By expected speed; ties: larger micro-batch, the recipe's loss, less memory."""
    return sorted(cands, key=lambda c: (round(c.score, 3), -c.batch_size, c.loss != recipe_loss, c.predicted_peak))
