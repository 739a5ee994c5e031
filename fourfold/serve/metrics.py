"""Prometheus metrics for `fourfold serve`: engine gauges read at scrape time, token counters, latency histograms.

Each server has its own registry (several servers in one test process do not collide). Names carry the
`fourfold_` prefix; the gauges mirror vLLM's (`num_requests_running`, `num_requests_waiting`,
KV-cache usage, prefix-cache hit rate) so existing dashboards map over.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from fourfold.infer.requests import EngineStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0)


class _EngineGauges:
    """A collector that asks the engine for its stats whenever Prometheus scrapes."""

    def __init__(self, stats: Callable[[], EngineStats], queued: Callable[[], int]):
        self.stats, self.queued = stats, queued

    def collect(self):
        s = self.stats()
        values = [("fourfold_num_requests_running", "Sequences the engine is running", s.running),
                  ("fourfold_num_requests_waiting", "Sequences waiting in the engine's queue", s.waiting),
                  ("fourfold_num_requests_in_server", "Requests the server has accepted and not finished",
                   self.queued()),
                  ("fourfold_kv_blocks_total", "KV-cache blocks in the pool", s.kv_blocks_total),
                  ("fourfold_kv_blocks_used", "KV-cache blocks held by sequences or the prefix cache", s.kv_blocks_used),
                  ("fourfold_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use",
                   s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0),
                  ("fourfold_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / tokens looked up",
                   s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0),
                  ("fourfold_num_preemptions", "Sequences preempted since start", s.preemptions)]
        for name, doc, value in values:
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], float(value))
            yield family


class ServerMetrics:
    """Counters and histograms the request handlers update, plus the engine's gauges."""

    def __init__(self, stats: Callable[[], EngineStats], queued: Callable[[], int]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineGauges(stats, queued))
        r = self.registry
        self.requests = Counter("fourfold_requests", "Finished requests by endpoint and finish reason",
                                ["endpoint", "finish_reason"], registry=r)
        self.rejected = Counter("fourfold_requests_rejected", "Requests answered with an error, by status", ["status"],
                                registry=r)
        self.prompt_tokens = Counter("fourfold_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("fourfold_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("fourfold_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("fourfold_inter_token_latency_seconds", "Time between a request's tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("fourfold_e2e_request_latency_seconds", "Request latency from arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
