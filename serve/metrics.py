"""Prometheus metrics, named like vLLM's (``vllm:`` prefix replaced by ``memfit:``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LAT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0)
_ITL = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "memfit:"
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prefilled prompt tokens.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens.", registry=r)
        self.finished = Counter(p + "request_success", "Finished sequences by finish reason.",
                                ["finished_reason"], registry=r)
        self.rejected = Counter(p + "request_rejected", "Requests refused (queue full, loading, draining).",
                                ["reason"], registry=r)
        self.running = Gauge(p + "num_requests_running", "Sequences holding a KV-cache slot.", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Sequences queued for a slot.", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of the KV cache in use (0-1): paged, blocks "
                              "held by running sequences; static, slot positions holding K/V.", registry=r)
        self.kv_blocks_free = Gauge(p + "kv_cache_blocks_free", "Paged KV-cache blocks no running sequence holds "
                                    "(prefix-cached ones included: reusable or evictable).", registry=r)
        self.kv_blocks_total = Gauge(p + "kv_cache_blocks_total", "Paged KV-cache blocks in all (static: slots).",
                                     registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                   "computed again).", registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Sequences preempted (by recompute) when the KV cache "
                                   "ran out of blocks.", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token.", buckets=_LAT, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=_ITL, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to finish of completed sequences.",
                             buckets=_LAT, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Arrival to slot admission.",
                                    buckets=_LAT, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineMetrics:
    """The engine's observations, recorded in one place: per step (tokens, queue gauges), per sequence
    (admission, each token's latency, finish). A no-op without a :class:`Metrics` (engines in tests, tools)."""

    __slots__ = ("m", "_kv_seen")

    def __init__(self, metrics: Metrics | None):
        self.m = metrics
        self._kv_seen = (0, 0, 0)  # prefix-cache queries, hits, preemptions already counted

    def kv(self, blocks_free: int, blocks_total: int, queries: int, hits: int, preemptions: int) -> None:
        """The KV cache's block gauges, and its running totals (the scheduler's and pool's) as counters."""
        m = self.m
        if m is None:
            return
        m.kv_blocks_free.set(blocks_free)
        m.kv_blocks_total.set(blocks_total)
        q, h, p = self._kv_seen
        if (queries, hits, preemptions) != (q, h, p):
            m.prefix_queries.inc(queries - q)
            m.prefix_hits.inc(hits - h)
            m.preemptions.inc(preemptions - p)
            self._kv_seen = (queries, hits, preemptions)

    def gauges(self, running: int, waiting: int, kv_usage: float) -> None:
        if self.m is not None:
            self.m.running.set(running)
            self.m.waiting.set(waiting)
            self.m.kv_usage.set(kv_usage)

    def admitted(self, arrival: float, now: float) -> None:
        if self.m is not None:
            self.m.queue_time.observe(now - arrival)

    def token(self, seq, now: float) -> None:
        """A sequence produced a token at ``now``: time to first token, or the gap since its previous one."""
        m = self.m
        if seq.first_token is None:
            seq.first_token = now
            if m is not None:
                m.ttft.observe(now - seq.arrival)
        elif m is not None:
            m.itl.observe(now - seq.last_token)
        seq.last_token = now

    def step(self, prompt_tokens: int, generated: int, kv_usage: float) -> None:
        m = self.m
        if m is not None:
            m.prompt_tokens.inc(prompt_tokens)
            m.generation_tokens.inc(generated)
            m.kv_usage.set(kv_usage)

    def finished(self, reason: str, arrival: float, now: float) -> None:
        m = self.m
        if m is not None:
            m.finished.labels(finished_reason=reason).inc()
            if reason in ("stop", "length"):
                m.e2e.observe(now - arrival)
