"""Continuous-batching engine: one scheduler loop (its own thread, or the caller's) owns the model and the slot
KV cache.

Each step: admit waiting sequences into free slots (FIFO), drop cancelled ones, then build one packed
batch: every running decode (1 token each) first, then prefill chunks (at most ``prefill_chunk``
prompt tokens per step in total, a long prompt spreads over several steps, interleaved with the
decodes of the others). Sequences join at the next step and leave as soon as they finish.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from memfit.runtime.slot_model import Segment, SlotModel
from serve.sampling import SamplerState, SamplingParams, greedy_tokens, top_logprobs

log = logging.getLogger("serve.engine")

_ids = itertools.count()


async def _let_io_run(loop: asyncio.AbstractEventLoop, rounds: int = 64) -> None:
    """Yield to the event loop until nothing is ready to run (each round also polls the sockets). A single
    yield would not do: a token's write, or a new request's parse/tokenize/submit, takes several rounds."""
    ready = getattr(loop, "_ready", None)  # asyncio's run queue (CPython's default loop)
    for _ in range(rounds):
        await asyncio.sleep(0)
        if ready is not None and not ready:
            return


class QueueFull(Exception):
    pass


class EngineStopped(Exception):
    pass


@dataclass
class TokenInfo:
    token_id: int
    text: str
    logprob: float | None = None
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Event:
    """What a sequence produced in one step: a text delta (maybe empty, held back for stop strings or
    incomplete UTF-8), the new token (with logprobs when asked), and on the last one finish_reason."""

    text: str = ""
    token: TokenInfo | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Event], None],
                 vocab_size: int):
        self.id = next(_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sink = sink
        self.sampler = SamplerState(params, self.prompt_ids, vocab_size)
        self.tokens = list(prompt_ids)
        self.out_ids: list[int] = []
        self.slot: int | None = None
        self.computed = 0  # tokens whose K/V are in the cache
        self.cancelled = False
        self.finished = False
        self.finish_reason: str | None = None
        self.text = ""
        self.emitted = 0
        self.stop_checked = 0
        self.arrival = time.monotonic()
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.prompt_ids)


class Engine:
    def __init__(self, model: SlotModel, tokenizer, eos_ids: set[int], prefill_chunk: int = 256,
                 max_queue: int = 64, metrics=None, own_thread: bool = True):
        self.model = model
        self.tok = tokenizer
        # the Rust tokenizer where the wrapper's decode adds nothing to it (see _decode), resolved once
        fast = getattr(tokenizer, "_tokenizer", None)
        self._rust_tok = fast if type(fast).__name__ == "Tokenizer" and \
            getattr(tokenizer, "clean_up_tokenization_spaces", True) is False else None
        self.eos_ids = set(eos_ids)
        self.max_batch = model.max_batch
        self.max_seq_len = model.max_seq_len
        self.prefill_chunk = max(1, prefill_chunk)
        self.max_queue = max_queue
        self.metrics = metrics
        self.lock = threading.Condition()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(self.max_batch))
        self._stop = False
        self.steps = 0
        self.step_hook: Callable[[list[Segment]], None] | None = None  # tests: observe / fault-inject
        self._done = threading.Event()
        self._started = False  # run() / run_async() entered (stop() waits for the loop only then)
        self._aloop: asyncio.AbstractEventLoop | None = None  # set while run_async() runs
        self._wake: asyncio.Event | None = None
        # own_thread=False: the caller runs the loop, with run() on a thread or run_async() on its event loop.
        # `serve` does the latter on the process's main thread: the same engine ran 1.3-1.6x faster there than
        # on a second thread (A/B in one script, 2 cores: concurrency 1 57-71 vs 35-41 tok/s, 16: 342-366 vs
        # 237-288; on a second thread every op, elementwise ones included, was 1.2-1.5x slower, with or without
        # the main thread's OpenMP pool)
        self.thread: threading.Thread | None = None
        if own_thread:
            self.thread = threading.Thread(target=self.run, name="serve-engine", daemon=True)
            self.thread.start()

    # ---- called from other threads -------------------------------------------------------------
    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences atomically; raise QueueFull when more than max_queue would wait."""
        with self.lock:
            if self._stop:
                raise EngineStopped()
            free = len(self.free_slots)
            if len(self.waiting) + len(seqs) > self.max_queue + free:
                raise QueueFull()
            self.waiting.extend(seqs)
            self._update_gauges()
            self._notify()

    def abort(self, seq: Sequence) -> None:
        if seq.finished:
            return
        with self.lock:
            seq.cancelled = True
            self._notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self.lock:
            self._stop = True
            self._notify()
        if self.thread is not None:
            self.thread.join(timeout)
        elif self._started:
            self._done.wait(timeout)

    def _notify(self) -> None:  # under self.lock: wake the loop, threaded or on an event loop
        self.lock.notify()
        if self._aloop is not None:
            self._aloop.call_soon_threadsafe(self._wake.set)

    @property
    def alive(self) -> bool:
        return not self._done.is_set()

    def run(self) -> None:
        """The scheduler loop; returns after stop(). Called by the engine's own thread, or by the caller."""
        self._started = True
        try:
            self._loop()
        finally:
            self._done.set()

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        used = sum(s.computed for s in list(self.running))
        return used / float(self.max_batch * self.max_seq_len)

    # ---- engine thread -------------------------------------------------------------------------
    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.running.set(len(self.running))
            self.metrics.waiting.set(len(self.waiting))
            self.metrics.kv_usage.set(self.kv_usage())

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, text: str = "") -> None:
        if seq.finished:
            return
        seq.finished = True
        seq.finish_reason = reason
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)
        m = self.metrics
        if m is not None:
            m.finished.labels(finished_reason=reason).inc()
            if reason in ("stop", "length"):
                m.e2e.observe(time.monotonic() - seq.arrival)
        try:
            seq.sink(Event(text=text, finish_reason=reason, error=error))
        except Exception:  # noqa: BLE001 - a broken consumer must not kill the engine
            log.exception("sink failed")

    def _next_batch(self, wait: bool) -> list[Sequence] | None:
        """Finish cancelled sequences, admit waiting ones into free slots (FIFO) and return the step's batch:
        [] when there is nothing to run, None once stopped. ``wait``: block while idle (the threaded loop)."""
        with self.lock:
            while wait and not self._stop and not self.waiting and not self.running:
                self.lock.wait(timeout=0.5)
            if self._stop:
                return None
            # cancellations (running and waiting) free their slots before this step
            for s in [s for s in self.running if s.cancelled]:
                self._finish(s, "abort")
            if any(s.cancelled for s in self.waiting):
                for s in [s for s in self.waiting if s.cancelled]:
                    self.waiting.remove(s)
                    self._finish(s, "abort")
            now = time.monotonic()
            while self.waiting and self.free_slots:
                s = self.waiting.popleft()
                s.slot = self.free_slots.pop(0)
                s.scheduled = now
                self.running.append(s)
                if self.metrics is not None:
                    self.metrics.queue_time.observe(now - s.arrival)
            self._update_gauges()
            return list(self.running)

    def _run_step(self, batch: list[Sequence]) -> None:
        try:
            self._step(batch)
        except Exception as e:  # noqa: BLE001 - fail the step's sequences, keep serving
            log.exception("engine step failed")
            with self.lock:
                for s in batch:
                    self._finish(s, "error", error=f"{type(e).__name__}: {e}")
                self._update_gauges()

    def _shutdown(self) -> None:
        with self.lock:
            for s in list(self.running) + list(self.waiting):
                self._finish(s, "abort", error="server shutting down")
            self.waiting.clear()
            self._update_gauges()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while (batch := self._next_batch(wait=True)) is not None:
            if batch:
                self._run_step(batch)
        self._shutdown()

    async def run_async(self) -> None:
        """The scheduler loop as a task on the HTTP server's event loop, in its thread: each step runs to the
        end, then the loop does the I/O the step made ready (token writes, newly arrived requests) before
        the next one. Why: with HTTP on a second thread, its Python ran *during* the steps and took a core
        from the 2 OpenMP threads of every matmul (a 16-request burst of 64-token prompts: prefill steps of
        ~100 ms offline took 125-130 ms under the server, measured minutes apart on a noisy host; the HTTP
        probe's concurrency 1 / 16 went 79.7 / 461 -> 86.9 / 510 tok/s with this). Returns after stop()."""
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._aloop = loop
        self._started = True
        try:
            while True:
                self._wake.clear()
                batch = self._next_batch(wait=False)
                if batch is None:
                    break
                if not batch:
                    await self._wake.wait()
                    continue
                with torch.inference_mode():
                    self._run_step(batch)
                await _let_io_run(loop)
            self._shutdown()
        finally:
            self._aloop = None
            self._done.set()

    def _step(self, batch: list[Sequence]) -> None:
        segs: list[Segment] = []
        ids: list[int] = []
        owners: list[Sequence] = []
        for s in batch:  # decodes first
            if not s.in_prefill:
                segs.append(Segment(s.slot, s.computed, 1))
                ids.append(s.tokens[s.computed])
                owners.append(s)
        budget = self.prefill_chunk
        for s in batch:
            if budget <= 0:
                break
            if s.in_prefill:
                n = min(budget, len(s.prompt_ids) - s.computed)
                last = s.computed + n == len(s.prompt_ids)
                segs.append(Segment(s.slot, s.computed, n, want_logits=last))
                ids.extend(s.tokens[s.computed:s.computed + n])
                owners.append(s)
                budget -= n
        if self.step_hook is not None:
            self.step_hook(segs)
        logits = self.model.forward(torch.tensor(ids, dtype=torch.long), segs)
        self.steps += 1
        now = time.monotonic()
        row = 0
        m = self.metrics
        n_prompt = 0
        n_gen = 0
        greedy: list[int] | None = None
        for seg, s in zip(segs, owners, strict=True):
            s.computed += seg.length
            if s.computed <= len(s.prompt_ids):
                n_prompt += seg.length
            if not seg.want_logits:
                continue
            lg = logits[row]
            row += 1
            if s.cancelled:
                continue
            try:  # a failure in one sequence's sampling/detokenizing fails that sequence only
                if s.sampler.plain_greedy:
                    if greedy is None:
                        greedy = greedy_tokens(logits)
                    tok = greedy[row - 1]
                else:
                    tok = s.sampler.sample(lg)
                info = None
                if s.params.logprobs is not None:
                    lp, top = top_logprobs(lg, tok, s.params.logprobs)
                    info = TokenInfo(tok, self._tok_text(tok), lp, [(self._tok_text(t), v) for t, v in top])
                self._append(s, tok, info, now)
                n_gen += 1
            except Exception as e:  # noqa: BLE001
                log.exception("sequence %d failed", s.id)
                with self.lock:
                    self._finish(s, "error", error=f"{type(e).__name__}: {e}")
        if m is not None:
            m.prompt_tokens.inc(n_prompt)
            m.generation_tokens.inc(n_gen)
            m.kv_usage.set(self.kv_usage())

    def _decode(self, ids: list[int]) -> str:
        """``tokenizer.decode(ids, skip_special_tokens=True)``; straight on the Rust tokenizer where that is all
        the wrapper would do (its argument checks cost ~25 us a call at 64 ids, 16 calls a 16-sequence step)."""
        if self._rust_tok is not None:
            return self._rust_tok.decode(ids, skip_special_tokens=True)
        return self.tok.decode(ids, skip_special_tokens=True)

    def _tok_text(self, tok: int) -> str:
        return self.tok.decode([tok], skip_special_tokens=False)

    def _append(self, s: Sequence, tok: int, info: TokenInfo | None, now: float) -> None:
        m = self.metrics
        if s.first_token is None:
            s.first_token = now
            if m is not None:
                m.ttft.observe(now - s.arrival)
        elif m is not None:
            m.itl.observe(now - s.last_token)
        s.last_token = now
        s.out_ids.append(tok)
        s.tokens.append(tok)
        s.sampler.observe(tok)
        p = s.params
        if tok in self.eos_ids and not p.ignore_eos:
            with self.lock:
                self._finish(s, "stop", text=s.text[s.emitted:])
            return
        text = self._decode(s.out_ids)
        finish = None
        if p.stop:
            start = max(0, s.stop_checked - max(len(x) for x in p.stop))
            hits = [i for i in (text.find(x, start) for x in p.stop if x) if i >= 0]
            if hits:
                text = text[:min(hits)]
                finish = "stop"
        if finish is None and len(s.out_ids) >= p.max_tokens:
            finish = "length"
        s.text = text
        s.stop_checked = len(text)
        if finish is not None:
            delta = text[s.emitted:]
            s.emitted = len(text)
            if info is not None:
                s.sink(Event(text="", token=info))
            with self.lock:
                self._finish(s, finish, text=delta)
            return
        safe = len(text)
        while safe > s.emitted and text[safe - 1] == "\ufffd":  # incomplete UTF-8 sequence
            safe -= 1
        if p.stop:
            hold = 0
            for x in p.stop:
                for k in range(min(len(x) - 1, safe - s.emitted), hold, -1):
                    if text[safe - k:safe] == x[:k]:
                        hold = k
                        break
            safe -= hold
        delta = text[s.emitted:safe]
        s.emitted = max(s.emitted, safe)
        s.sink(Event(text=delta, token=info))
