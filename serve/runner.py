"""Runs a :class:`~serve.scheduler.StepPlan` on the model: the plan's tokens packed into one id tensor with a
:class:`~memfit.runtime.slot_model.Segment` per sequence (its slot, first position, length), one
``SlotModel.forward``, and the logits rows of the sequences that sample this step.

With a paged KV cache the runner also writes the planned sequences' block lists into the model's block tables
(``SlotModel.block_tables[group, slot, :n]``, one per KV group), which the forward reads. Only what changed since
the last step: block lists only grow while their sequence runs (one new block per group every ``block_size``
tokens), so most decode steps write nothing; a row whose sequence changed (a new or resumed sequence in that
slot) is written whole. An entry a sliding group dropped (``NULL_BLOCK``) is written as block 0, or left as it
was: attention never uses a block behind its window (the kernels skip it; the gathering fallbacks slice or mask
it away)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.runtime.slot_model import Segment, SlotModel
from serve.scheduler import StepPlan


class ModelRunner:
    def __init__(self, model: SlotModel):
        self.model = model
        self.step_hook: Callable[[list[Segment]], None] | None = None  # tests: observe / fault-inject a step
        self.paged = bool(getattr(model, "paged", False))
        # per slot: (the block lists written into its rows, how many entries): a sequence's list object is
        # replaced, not cleared, when it loses its blocks, so `is` tells a new list from a grown one
        self._rows: list[tuple[list[list[int]] | None, int]] = [(None, 0)] * model.max_batch

    def write_block_table(self, plan: StepPlan) -> None:
        """Bring the planned sequences' rows of ``model.block_tables`` up to date (their blocks only grow)."""
        tables = self.model.block_tables
        rows = self._rows
        for s in plan.seqs:
            blocks, slot = s.blocks, s.slot
            n = len(blocks[0])
            old, done = rows[slot]
            if old is blocks:
                if done == n:
                    continue
            else:
                done = 0
            new = [row[done:n] for row in blocks]
            tables[:, slot, done:n] = torch.tensor(new, dtype=torch.long).clamp_(min=0)  # NULL_BLOCK -> 0
            rows[slot] = (blocks, n)

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
        if self.paged:
            self.write_block_table(plan)
        if self.step_hook is not None:
            self.step_hook(segs)
        logits = self.model.forward(torch.tensor(ids, dtype=torch.long), segs)
        return logits, rows
