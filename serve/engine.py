"""Continuous-batching engine: one loop (its own thread, or the caller's: a thread or an asyncio task) owns the
model and its KV cache, and composes the named parts, as vLLM v1's engine core does:

- :class:`~serve.scheduler.Scheduler`: admission (FIFO), cancellation, the step plan (all decodes, then prefill
  chunks within ``prefill_chunk``), KV blocks and preemption (:class:`~serve.kv_blocks.BlockPool`, when the
  model's cache is paged) and closing the step (EOS, max_tokens);
- :class:`~serve.runner.ModelRunner`: the plan as packed ids + Segments (and block-table rows), one
  ``SlotModel.forward``;
- :func:`~serve.sampling.sample_rows`: each sequence's next token (one argmax for the plain-greedy ones);
- :class:`~serve.detokenizer.IncrementalDetokenizer`: text deltas of the new tokens only, stop strings;
- :class:`~serve.metrics.EngineMetrics`: the Prometheus observations.

Each sequence's Events go to its ``sink`` (a :class:`~serve.stream.RequestStream` under the HTTP server).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import torch

from memfit.runtime.slot_model import Segment, SlotModel
from serve.detokenizer import IncrementalDetokenizer, fast_decode
from serve.kv_blocks import BlockPool
from serve.metrics import EngineMetrics
from serve.runner import ModelRunner
from serve.sampling import sample_rows, top_logprobs
from serve.scheduler import EngineStopped, QueueFull, Scheduler, StepPlan
from serve.sequence import Event, Sequence, TokenInfo

__all__ = ["Engine", "EngineStopped", "Event", "QueueFull", "Sequence", "TokenInfo"]

log = logging.getLogger("serve.engine")


async def _let_io_run(loop: asyncio.AbstractEventLoop, rounds: int = 64) -> None:
    """Yield to the event loop until nothing is ready to run (each round also polls the sockets). A single
    yield would not do: a token's write, or a new request's parse/tokenize/submit, takes several rounds."""
    ready = getattr(loop, "_ready", None)  # asyncio's run queue (CPython's default loop)
    for _ in range(rounds):
        await asyncio.sleep(0)
        if ready is not None and not ready:
            return


class Engine:
    def __init__(self, model: SlotModel, tokenizer, eos_ids: set[int], prefill_chunk: int = 256,
                 max_queue: int = 64, metrics=None, own_thread: bool = True, prefix_caching: bool = True):
        """``prefix_caching``: reuse cached full KV blocks of identical prompt prefixes (paged models only; a
        model without ``paged`` runs static slots)."""
        self.model = model
        self.tok = tokenizer
        self._decode = fast_decode(tokenizer)  # resolved once: every sequence's detokenizer uses it
        self.eos_ids = set(eos_ids)
        self.max_batch = model.max_batch
        self.max_seq_len = model.max_seq_len
        self.prefill_chunk = max(1, prefill_chunk)
        self.max_queue = max_queue
        self.metrics = metrics
        self.stats = EngineMetrics(metrics)
        self.pool = BlockPool(model.num_blocks, model.block_size, prefix_caching, model.kv_groups.windows) \
            if getattr(model, "paged", False) else None
        self.scheduler = Scheduler(self.max_batch, self.max_seq_len, self.prefill_chunk, max_queue, self.eos_ids,
                                   self.pool)
        self.runner = ModelRunner(model)
        self.lock = self.scheduler.lock
        self.steps = 0
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

    # ---- the parts' state, as callers and tests know it ------------------------------------------
    @property
    def step_hook(self) -> Callable[[list[Segment]], None] | None:
        return self.runner.step_hook

    @step_hook.setter
    def step_hook(self, hook: Callable[[list[Segment]], None] | None) -> None:
        self.runner.step_hook = hook

    @property
    def free_slots(self) -> list[int]:
        return self.scheduler.free_slots

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop whose thread runs the engine (run_async), else None: its sinks are called there."""
        return self._aloop

    @property
    def alive(self) -> bool:
        return not self._done.is_set()

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_usage(self) -> float:
        return self.scheduler.kv_usage()

    def update_gauges(self) -> None:
        self.stats.gauges(self.num_running(), self.num_waiting(), self.kv_usage())
        p = self.pool
        if p is not None:
            self.stats.kv(p.num_free, p.num_blocks, p.queries, p.hits, self.scheduler.num_preemptions)

    def kv_info(self) -> dict:
        """The KV cache as /health shows it."""
        p, m = self.pool, self.model
        caches = getattr(m, "k_cache", None)  # the generic engine has none: HF's cache, in the model's dtype
        dtype = str(caches[0].dtype).removeprefix("torch.") if caches else "model"
        if p is None:
            return {"paged": False, "slots": self.max_batch, "slot_tokens": self.max_seq_len,
                    "bytes": getattr(m, "cache_bytes", None), "prefix_caching": False, "dtype": dtype}
        groups = m.kv_groups  # a block is block_size positions in every layer of one group (kv_groups.py)
        return {"paged": True, "dtype": dtype, "block_size": p.block_size, "blocks_total": p.num_blocks,
                "kv_groups": len(groups), "layers_per_block": groups.size,
                "sliding_windows": groups.sliding_windows,
                "blocks_free": p.num_free, "blocks_cached": p.num_cached, "bytes": p.num_blocks * m.bytes_per_block,
                "prefix_caching": p.enable_prefix_caching, "prefix_cache_queries": p.queries,
                "prefix_cache_hits": p.hits, "preemptions": self.scheduler.num_preemptions}

    def kv_leaks(self) -> list[str]:
        """With nothing running: the blocks not back in the pool (tests, the soak); [] when all are."""
        return [] if self.pool is None else self.pool.leaks()

    # ---- called from other threads -------------------------------------------------------------
    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences atomically; raise QueueFull when more than max_queue would wait."""
        for s in seqs:
            if s.detok is None:
                s.detok = IncrementalDetokenizer(self._decode, s.params.stop)
        with self.lock:
            self.scheduler.add(seqs)
            self.update_gauges()
            self._notify()

    def abort(self, seq: Sequence) -> None:
        if seq.finished:
            return
        with self.lock:
            seq.cancelled = True
            self._notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self.lock:
            self.scheduler.stopped = True
            self._notify()
        if self.thread is not None:
            self.thread.join(timeout)
        elif self._started:
            self._done.wait(timeout)

    def _notify(self) -> None:  # under self.lock: wake the loop, threaded or on an event loop
        self.lock.notify()
        if self._aloop is not None:
            self._aloop.call_soon_threadsafe(self._wake.set)

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        """The engine loop; returns after stop(). Called by the engine's own thread, or by the caller."""
        self._started = True
        try:
            torch.set_grad_enabled(False)
            while (plan := self._next_plan(wait=True)) is not None:
                if plan.seqs:
                    self._run_step(plan)
            self._shutdown()
        finally:
            self._done.set()

    async def run_async(self) -> None:
        """The engine loop as a task on the HTTP server's event loop, in its thread: each step runs to the
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
                plan = self._next_plan(wait=False)
                if plan is None:
                    break
                if not plan.seqs:
                    await self._wake.wait()
                    continue
                with torch.inference_mode():
                    self._run_step(plan)
                await _let_io_run(loop)
            self._shutdown()
        finally:
            self._aloop = None
            self._done.set()

    def _next_plan(self, wait: bool) -> StepPlan | None:
        """The next step's plan (empty when there is nothing to run), None once stopped. ``wait``: block while
        idle (the threaded loop). Reports the sequences cancelled since the last step."""
        sch = self.scheduler
        with self.lock:
            while wait and not sch.stopped and not sch.has_work():
                self.lock.wait(timeout=0.5)
            if sch.stopped:
                return None
        plan = sch.schedule()
        for s in plan.aborted:
            self._report_finish(s, "abort")
        for s, why in plan.failed:
            self._report_finish(s, "error", error=why)
        if plan.admitted:
            now = time.monotonic()
            for s in plan.admitted:
                self.stats.admitted(s.arrival, now)
        self.update_gauges()
        return plan

    def _run_step(self, plan: StepPlan) -> None:
        try:
            self._step(plan)
        except Exception as e:  # noqa: BLE001 - fail the step's sequences, keep serving
            log.exception("engine step failed")
            for s in plan.seqs:
                if self.scheduler.finish(s, "error"):
                    self._report_finish(s, "error", error=f"{type(e).__name__}: {e}")
            self.update_gauges()

    def _shutdown(self) -> None:
        for s in self.scheduler.drain():
            self._report_finish(s, "abort", error="server shutting down")
        self.update_gauges()

    def _step(self, plan: StepPlan) -> None:
        logits, rows = self.runner.execute(plan)
        self.steps += 1
        now = time.monotonic()
        seqs = plan.seqs
        # a sequence cancelled during the step samples nothing; the next schedule() finishes it
        toks = sample_rows([None if seqs[i].cancelled else seqs[i].sampler for i in rows], logits)
        sampled: list[int | None] = [None] * len(seqs)
        infos: dict[int, TokenInfo] | None = None
        for r, i in enumerate(rows):
            tok = toks[r]
            if tok is None:
                continue
            s = seqs[i]
            try:  # a failure in one sequence's sampling or logprobs fails that sequence only
                if isinstance(tok, Exception):
                    raise tok
                s.sampler.observe(tok)
                if s.params.logprobs is not None:
                    if infos is None:
                        infos = {}
                    infos[i] = self._token_info(logits[r], tok, s.params.logprobs)
                sampled[i] = tok
            except Exception as e:  # noqa: BLE001
                self._fail(s, e)
        self.scheduler.update_from_output(plan, sampled)
        n_gen = 0
        for i, tok in enumerate(sampled):
            if tok is not None:
                n_gen += 1
                self._emit(seqs[i], tok, infos.get(i) if infos is not None else None, now)
        self.stats.step(sum(plan.num_tokens[plan.num_decodes:]), n_gen, self.kv_usage())

    def _emit(self, s: Sequence, tok: int, info: TokenInfo | None, now: float) -> None:
        """Detokenize ``s``'s new token and send its Event; the last one also carries the finish reason."""
        try:
            self.stats.token(s, now)
            d = s.detok
            if s.finished:  # by the scheduler: EOS or max_tokens
                if s.finish_reason == "stop":  # EOS: no text of its own, send what is held back
                    self._report_finish(s, "stop", text=d.flush())
                    return
                text, hit = d.add(tok, final=True)
                if hit:
                    s.finish_reason = "stop"
            else:
                text, hit = d.add(tok)
                if not hit:
                    s.sink(Event(text=text, token=info))
                    return
                self.scheduler.finish(s, "stop")
            if info is not None:
                s.sink(Event(text="", token=info))
            self._report_finish(s, s.finish_reason, text=text)
        except Exception as e:  # noqa: BLE001
            self._fail(s, e)

    def _fail(self, s: Sequence, e: Exception) -> None:
        log.exception("sequence %d failed", s.id, exc_info=e)
        self.scheduler.finish(s, "error")
        s.finish_reason = "error"
        self._report_finish(s, "error", error=f"{type(e).__name__}: {e}")

    def _report_finish(self, s: Sequence, reason: str, error: str | None = None, text: str = "") -> None:
        self.stats.finished(reason, s.arrival, time.monotonic())
        try:
            s.sink(Event(text=text, finish_reason=reason, error=error))
        except Exception:  # noqa: BLE001 - a broken consumer must not kill the engine
            log.exception("sink failed")

    def _token_info(self, logits: torch.Tensor, tok: int, k: int) -> TokenInfo:
        lp, top = top_logprobs(logits, tok, k)
        return TokenInfo(tok, self._tok_text(tok), lp, [(self._tok_text(t), v) for t, v in top])

    def _tok_text(self, tok: int) -> str:
        return self.tok.decode([tok], skip_special_tokens=False)
