"""Which parameters train: `trainable` / `freeze` regexes and the `stages` schedule of them.

Freezing is `requires_grad = False`, so a frozen parameter gets no gradient and the optimizer (built from
the trainable parameters only) holds no state for it. Stages switch the trainable set at step boundaries;
at a switch the optimizer is rebuilt and parameters that keep training keep their AdamW moments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from memfit.errors import UserError
from training.config import TrainConfig


@dataclass(frozen=True)
class Stage:
    index: int
    """Position in `stages` (0 when the recipe has no stages)."""
    start: int
    """First optimizer step of the stage."""
    trainable: tuple[str, ...]
    """Regexes of the parameters that train; empty: every parameter that would train anyway."""
    freeze: tuple[str, ...]
    """Regexes of parameters frozen on top of that."""


def stage_at(cfg: TrainConfig, step: int) -> Stage:
    """The stage optimizer step `step` (0-based) belongs to."""
    if not cfg.stages:
        return Stage(0, 0, tuple(cfg.trainable), tuple(cfg.freeze))
    start = 0
    for i, s in enumerate(cfg.stages):
        end = start + s["steps"] if s.get("steps") else None
        if end is None or step < end or i == len(cfg.stages) - 1:
            return Stage(i, start, tuple(s.get("trainable", [])), tuple(s.get("freeze", [])))
        start = end
    raise AssertionError("unreachable")


def apply_stage(model: torch.nn.Module, stage: Stage, base: dict[str, bool], where: str) -> list[str]:
    """Set requires_grad from `stage` over the `base` set (what trains without patterns: all weights, or
    LoRA's adapters); returns the names that train. A pattern that matches nothing is an error naming it."""
    names = list(base)
    for key, patterns in (("trainable", stage.trainable), ("freeze", stage.freeze)):
        for pat in patterns:
            try:
                rx = re.compile(pat)
            except re.error as e:
                raise UserError(f"{where}{key}: {pat!r} is not a valid regex ({e})") from None
            if not any(rx.search(n) for n in names):
                example = ", ".join(names[:3])
                raise UserError(f"{where}{key}: {pat!r} matches no parameter of this model (names look like "
                                f"{example}, ...)")
    train_rx = [re.compile(p) for p in stage.trainable]
    freeze_rx = [re.compile(p) for p in stage.freeze]
    trains = []
    for name, p in model.named_parameters():
        on = base.get(name, False)
        if train_rx:
            on = on and any(r.search(name) for r in train_rx)
        if any(r.search(name) for r in freeze_rx):
            on = False
        p.requires_grad_(on)
        if on:
            trains.append(name)
    if not trains:
        raise UserError(f"{where}trainable/freeze: no parameter is left to train")
    return trains


def stage_label(cfg: TrainConfig, stage: Stage) -> str:
    return f"stages[{stage.index}]." if cfg.stages else ""
