"""Which sequences run in the next step, and how many tokens each: the engine's scheduler.

It owns the waiting queue (FIFO), the running list and the free KV-cache slots. ``schedule()`` drops cancelled
sequences, admits waiting ones into free slots (in arrival order, no preemption: a running sequence keeps its
slot until it finishes) and returns a :class:`StepPlan`: every running decode (1 token each) first, then
prefill chunks, at most ``prefill_chunk`` prompt tokens in total per step, so a long prompt spreads over
several steps interleaved with the others' decodes. ``update_from_output()`` closes the step: the K/V of the
planned tokens are cached, sampled tokens are appended, and a sequence that sampled EOS or reached its
``max_tokens`` is finished and leaves its slot at once.

``lock`` guards the queues: ``add``/``cancel`` come from other threads (the HTTP handlers).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from serve.sequence import Sequence


class QueueFull(Exception):
    pass


class EngineStopped(Exception):
    pass


@dataclass(slots=True)
class StepPlan:
    """One step: ``seqs[i]`` runs its next ``num_tokens[i]`` tokens; the decodes come first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    aborted: list[Sequence] = field(default_factory=list)  # cancelled before this step, to be reported
    admitted: list[Sequence] = field(default_factory=list)  # got a slot for this step

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, max_batch: int, max_seq_len: int, prefill_chunk: int, max_queue: int, eos_ids: set[int]):
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.prefill_chunk = max(1, prefill_chunk)
        self.max_queue = max_queue
        self.eos_ids = set(eos_ids)
        self.lock = threading.Condition()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_batch))
        self.stopped = False

    # ---- any thread ------------------------------------------------------------------------------
    def add(self, seqs: list[Sequence]) -> None:
        """Queue sequences atomically; QueueFull when more than max_queue would wait for a slot."""
        with self.lock:
            if self.stopped:
                raise EngineStopped()
            if len(self.waiting) + len(seqs) > self.max_queue + len(self.free_slots):
                raise QueueFull()
            self.waiting.extend(seqs)
            self.lock.notify()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_usage(self) -> float:
        """Fraction of the slot cache's positions holding K/V."""
        used = sum(s.computed for s in list(self.running))
        return used / float(self.max_batch * self.max_seq_len)

    # ---- the engine's loop -----------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str) -> bool:
        """Mark ``seq`` finished and give its slot back; False when it already was."""
        with self.lock:
            if seq.finished:
                return False
            seq.finished = True
            seq.finish_reason = reason
            if seq.slot is not None:
                self.free_slots.append(seq.slot)
                seq.slot = None
            if seq in self.running:
                self.running.remove(seq)
            return True

    def schedule(self) -> StepPlan:
        """Drop cancelled sequences (into ``plan.aborted``), admit waiting ones, plan the step."""
        plan = StepPlan()
        with self.lock:
            # cancellations (running and waiting) free their slots before this step
            for s in [s for s in self.running if s.cancelled]:
                if self.finish(s, "abort"):
                    plan.aborted.append(s)
            if any(s.cancelled for s in self.waiting):
                for s in [s for s in self.waiting if s.cancelled]:
                    self.waiting.remove(s)
                    if self.finish(s, "abort"):
                        plan.aborted.append(s)
            if self.waiting and self.free_slots:
                now = time.monotonic()
                while self.waiting and self.free_slots:
                    s = self.waiting.popleft()
                    s.slot = self.free_slots.pop(0)
                    s.scheduled = now
                    self.running.append(s)
                    plan.admitted.append(s)
            batch = list(self.running)
        seqs, num = plan.seqs, plan.num_tokens
        for s in batch:  # decodes first
            if not s.in_prefill:
                seqs.append(s)
                num.append(1)
        plan.num_decodes = len(seqs)
        budget = self.prefill_chunk
        for s in batch:
            if budget <= 0:
                break
            if s.in_prefill:
                n = min(budget, len(s.prompt_ids) - s.computed)
                seqs.append(s)
                num.append(n)
                budget -= n
        return plan

    def update_from_output(self, plan: StepPlan, sampled: list[int | None]) -> None:
        """Close the step: ``sampled[i]`` is ``plan.seqs[i]``'s new token (None: mid-prefill, cancelled or
        failed). Finishes sequences on EOS ("stop") or at max_tokens ("length")."""
        eos = self.eos_ids
        for s, n, tok in zip(plan.seqs, plan.num_tokens, sampled, strict=True):
            s.computed += n
            if tok is None or s.finished:
                continue
            s.out_ids.append(tok)
            s.tokens.append(tok)
            p = s.params
            if tok in eos and not p.ignore_eos:
                self.finish(s, "stop")
            elif len(s.out_ids) >= p.max_tokens:
                self.finish(s, "length")

    def drain(self) -> list[Sequence]:
        """Stop: finish every running and waiting sequence ("abort") and return them."""
        with self.lock:
            self.stopped = True
            out = [s for s in list(self.running) + list(self.waiting) if self.finish(s, "abort")]
            self.waiting.clear()
            return out
