"""Which sequences run in the next step, and how many tokens each: the engine's scheduler.

It owns the waiting queue (FIFO), the running list, the free sequence slots (rows of the model's block table,
at most ``max_batch`` run) and, with a paged KV cache, the :class:`~serve.kv_blocks.BlockPool`. ``schedule()``
drops cancelled sequences, plans the running ones and admits waiting ones, and returns a :class:`StepPlan`:
every running decode (1 token each) first, then prefill chunks, at most ``prefill_chunk`` prompt tokens in total
per step, so a long prompt spreads over several steps interleaved with the others' decodes.
``update_from_output()`` closes the step: the K/V of the planned tokens are cached (full blocks registered in
the prefix cache), sampled tokens are appended, and a sequence that sampled EOS or reached its ``max_tokens``
is finished and gives its slot and blocks back at once.

Static KV cache (no pool: ``--kv-cache static``, and models without a paged cache): a sequence owns a slot of
``max_seq_len`` positions from admission (FIFO, whenever a slot is free) to its end; nothing is preempted.

Paged KV cache (as vLLM v1): each step gives every planned sequence the blocks its new tokens need, in
admission order. When the pool runs dry the most recently admitted running sequence is *preempted by
recompute*: its blocks go back, it returns to the front of the waiting queue, and later prefills its prompt and
generated tokens again (its full blocks stay in the prefix cache meanwhile, so it mostly finds them) and goes on
where it stopped. A waiting sequence is admitted (FIFO: the head waits, none skips it) when a slot is free, the
step has prefill budget left and the pool has the blocks of its first chunk and (others running) of its whole
prompt besides those the running ones will take soon (``_reserved``); none is admitted in a step that
preempted. A sequence that cannot fit even alone fails with an error instead of waiting forever.

``lock`` guards the queues: ``add``/``cancel`` come from other threads (the HTTP handlers).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from memfit.runtime.kv_groups import NULL_BLOCK, blocks_for
from serve.kv_blocks import BlockPool
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
    admitted: list[Sequence] = field(default_factory=list)  # got a slot for the first time this step
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # can never fit the KV cache: (seq, why)
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting (paged cache full)

    def __len__(self) -> int:
        return len(self.seqs)


def _held(rows: list[list[int]]) -> int:
    """The blocks in a sequence's block lists (entries a sliding group dropped, ``NULL_BLOCK``, not counted)."""
    return sum(b != NULL_BLOCK for row in rows for b in row)


class Scheduler:
    def __init__(self, max_batch: int, max_seq_len: int, prefill_chunk: int, max_queue: int, eos_ids: set[int],
                 pool: BlockPool | None = None):
        """``pool``: the paged KV cache's blocks (None: static slots of ``max_seq_len`` positions)."""
        self.pool = pool
        self.num_preemptions = 0
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
        """Paged: fraction of the blocks held by running sequences; static: of the slots' positions holding K/V."""
        if self.pool is not None:
            return self.pool.usage()
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
            self._release_blocks(seq)
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
            if self.pool is not None:
                self._schedule_paged(plan)
                return plan
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
                n = min(budget, s.prefill_len - s.computed)
                seqs.append(s)
                num.append(n)
                budget -= n
        return plan

    # ---- paged KV cache ----------------------------------------------------------------------------
    def _schedule_paged(self, plan: StepPlan) -> None:
        """Under the lock: grow the running sequences' blocks (preempting from the tail when the pool is dry),
        then admit from the head of the queue while the pool holds their first chunk."""
        pool = self.pool
        bs = pool.block_size
        budget = self.prefill_chunk
        seqs, num = plan.seqs, plan.num_tokens  # the decodes, then (appended at the end) the prefill chunks
        chunks: list[tuple[Sequence, int]] = []
        running = self.running
        i = 0
        while i < len(running):  # admission order: a victim (the tail) is never one planned before
            s = running[i]
            prefill = s.computed < s.prefill_len
            if prefill:
                if budget <= 0:
                    i += 1
                    continue
                n = min(budget, s.prefill_len - s.computed)
            else:
                n = 1
            if s.computed + n > len(s.blocks[0]) * bs:  # else its last block has room (most decode steps)
                while not self._grow(s, s.computed + n):
                    if len(running) == 1:  # alone and still short: the pool can never hold it
                        self._fail(plan, s, f"needs more than the KV cache's {pool.num_blocks} blocks of {bs} "
                                            "tokens")
                        break
                    victim = running[-1]
                    self._preempt(victim)
                    plan.preempted.append(victim)
                    if victim is s:
                        break
                if s.slot is None:  # preempted or failed: it was the last one
                    break
            if prefill:
                chunks.append((s, n))
                budget -= n
            else:
                seqs.append(s)
                num.append(1)
            i += 1
        if not plan.preempted:
            now = time.monotonic()
            while self.waiting and self.free_slots and budget > 0:
                s = self.waiting[0]
                n = self._admit_paged(s, budget, plan)
                if n is None:
                    break
                if n:
                    if s.scheduled is None:  # its first admission (not a resume after a preemption)
                        s.scheduled = now
                        plan.admitted.append(s)
                    chunks.append((s, n))
                    budget -= n
        plan.num_decodes = len(seqs)
        for s, n in chunks:
            seqs.append(s)
            num.append(n)

    def _admit_paged(self, s: Sequence, budget: int, plan: StepPlan) -> int | None:
        """Admit the queue's head ``s`` if the pool holds its first chunk (after its prefix-cache hit): the
        chunk's token count; 0 when it failed instead (too large for the whole pool); None when it must wait."""
        pool = self.pool
        bs = pool.block_size
        total = max(min(len(s.prompt_ids) + s.params.max_tokens - 1, self.max_seq_len), len(s.tokens))
        held = pool.blocks_held(total, self.prefill_chunk)  # the most it holds at once (sliding groups drop)
        if held > pool.num_blocks:
            self.waiting.popleft()
            self._fail(plan, s, f"needs {held} KV blocks of {bs} tokens ({total} positions), the cache has "
                                f"{pool.num_blocks}")
            return 0
        hit = pool.match(s.tokens, s.block_hashes, count=False)
        k = len(hit[0])
        computed = k * bs
        n = min(budget, s.prefill_len - computed)
        need = blocks_for(computed + n, bs) - k
        reused_free = sum(1 for row in hit for b in row if b != NULL_BLOCK and pool.ref[b] == 0)  # leave the free queue
        if need * len(hit) + reused_free > pool.num_free:
            return None
        if self.running:  # and the rest of its prompt, besides what the running ones will take soon
            whole = pool.blocks_held(s.prefill_len, self.prefill_chunk) - _held(hit)
            if max(whole, need * len(hit)) + reused_free + self._reserved() > pool.num_free:
                return None
        self.waiting.popleft()
        if s.num_preemptions == 0 and pool.enable_prefix_caching:  # a first admission is a query (a resume not)
            pool.queries += len(s.tokens)
            pool.hits += computed
        for row in hit:
            pool.take(row)
        new = pool.allocate(need * len(hit))
        s.blocks = [row + new[g * need:(g + 1) * need] for g, row in enumerate(hit)]
        s.num_registered = k
        s.computed = computed
        if s.num_preemptions == 0:
            s.cache_hit = computed
        s.slot = self.free_slots.pop(0)
        self.running.append(s)
        return n

    def _reserved(self) -> int:
        """Blocks the running sequences will take soon: the rest of their prompts, or (decoding) one more in
        every group. Admission leaves them free, so that a prompt admitted now does not force a preemption by
        recompute a few steps later (at 64 mixed requests at once on Gemma 3, first-chunk-only admission fed
        56% more prompt tokens than the workload has, all of it recompute)."""
        pool = self.pool
        out = 0
        for r in self.running:
            if r.computed < r.prefill_len:
                out += max(0, pool.blocks_held(r.prefill_len, self.prefill_chunk) - _held(r.blocks))
            else:
                out += len(r.blocks)
        return out

    def _grow(self, s: Sequence, num_tokens: int) -> bool:
        """Give ``s`` the blocks covering its first ``num_tokens`` positions; False (nothing taken) if short."""
        need = blocks_for(num_tokens, self.pool.block_size) - len(s.blocks[0])
        if need <= 0:
            return True
        new = self.pool.allocate(need * len(s.blocks))
        if new is None:
            return False
        for g, row in enumerate(s.blocks):
            row.extend(new[g * need:(g + 1) * need])
        return True

    def _release_blocks(self, s: Sequence) -> None:
        """``s`` gives back every block it holds, in every KV group."""
        for row in s.blocks:
            self.pool.release(row)
        s.blocks = []

    def _preempt(self, s: Sequence) -> None:
        """Preempt by recompute: ``s`` gives back its slot and blocks and waits at the queue's front; it will
        prefill its prompt and generated tokens again (``prefill_len``) and sample its next token after that."""
        self.running.remove(s)
        self._release_blocks(s)
        s.num_registered = 0
        self.free_slots.append(s.slot)
        s.slot = None
        s.computed = 0
        s.prefill_len = len(s.tokens)
        s.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(s)

    def _fail(self, plan: StepPlan, s: Sequence, why: str) -> None:
        if self.finish(s, "error"):
            plan.failed.append((s, f"KV cache too small: this sequence {why}"))

    def update_from_output(self, plan: StepPlan, sampled: list[int | None]) -> None:
        """Close the step: ``sampled[i]`` is ``plan.seqs[i]``'s new token (None: mid-prefill, cancelled or
        failed). Finishes sequences on EOS ("stop") or at max_tokens ("length")."""
        eos = self.eos_ids
        pool = self.pool
        register = pool is not None and pool.enable_prefix_caching
        drop = pool is not None and pool.sliding
        for s, n, tok in zip(plan.seqs, plan.num_tokens, sampled, strict=True):
            s.computed += n
            if register and s.computed >= (s.num_registered + 1) * pool.block_size and s.blocks:
                # newly full blocks, generated tokens included
                full = min(s.computed // pool.block_size, len(s.blocks[0]))
                hashes = pool.extend_hashes(s.tokens, s.block_hashes, full)
                for g, row in enumerate(s.blocks):
                    pool.register(row, hashes, s.num_registered, full, g)
                s.num_registered = full
            if drop and s.blocks:  # blocks behind a sliding window go back
                pool.drop_behind(s.blocks, s.computed)
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
