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
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV-cache token positions in use (0-1).",
                              registry=r)
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

    __slots__ = ("m",)

    def __init__(self, metrics: Metrics | None):
        self.m = metrics

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
