"""Runs a :class:`~serve.scheduler.StepPlan` on the model: the plan's tokens packed into one id tensor with a
:class:`~memfit.runtime.slot_model.Segment` per sequence (its slot, first position, length), one
``SlotModel.forward``, and the logits rows of the sequences that sample this step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.runtime.slot_model import Segment, SlotModel
from serve.scheduler import StepPlan


class ModelRunner:
    def __init__(self, model: SlotModel):
        self.model = model
        self.step_hook: Callable[[list[Segment]], None] | None = None  # tests: observe / fault-inject a step

    def execute(self, plan: StepPlan) -> tuple[torch.Tensor, list[int]]:
        """Run the step; return the logits [rows, V] and, per row, the index of its sequence in the plan. A
        sequence wants logits when this step reaches the end of its tokens (a decode, or its last prefill
        chunk): its next token is sampled from them."""
        segs: list[Segment] = []
        ids: list[int] = []
        rows: list[int] = []
        for i, (s, n) in enumerate(zip(plan.seqs, plan.num_tokens, strict=True)):
            c = s.computed
            want = c + n == len(s.tokens)
            segs.append(Segment(s.slot, c, n, want_logits=want))
            if n == 1:
                ids.append(s.tokens[c])
            else:
                ids.extend(s.tokens[c:c + n])
            if want:
                rows.append(i)
        if self.step_hook is not None:
            self.step_hook(segs)
        logits = self.model.forward(torch.tensor(ids, dtype=torch.long), segs)
        return logits, rows
