"""Prometheus metrics: request counters and latency histograms recorded by the server, plus the
engine's own state (queue, KV blocks, prefix cache, preemptions, attention path) read at scrape.

Each app gets its own registry, so several servers in one process (tests) never collide.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.request.outputs import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:  # still loading
            return
        yield GaugeMetricFamily("fdserve_num_requests_waiting", "Sequences waiting to be scheduled (queue depth)",
                                value=stats.num_waiting)
        yield GaugeMetricFamily("fdserve_num_requests_running", "Sequences in the running batch",
                                value=stats.num_running)
        yield GaugeMetricFamily("fdserve_kv_blocks_total", "KV cache blocks", value=stats.num_total_blocks)
        yield GaugeMetricFamily("fdserve_kv_blocks_free", "Free KV cache blocks", value=stats.num_free_blocks)
        yield GaugeMetricFamily("fdserve_kv_cache_usage_ratio", "Fraction of KV blocks in use", value=stats.kv_usage)
        yield InfoMetricFamily("fdserve_kv_cache", "The KV cache pages' dtype", value={"dtype": stats.kv_cache_dtype})
        yield CounterMetricFamily("fdserve_prefix_cache_queries", "Prompt blocks looked up in the prefix cache",
                                  value=stats.prefix_cache_queries)
        yield CounterMetricFamily("fdserve_prefix_cache_hits", "Prompt blocks found in the prefix cache",
                                  value=stats.prefix_cache_hits)
        rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        yield GaugeMetricFamily("fdserve_prefix_cache_hit_rate", "Prefix cache hits / queries since start",
                                value=rate)
        yield CounterMetricFamily("fdserve_preemptions", "Sequences preempted (recomputed later)",
                                  value=stats.num_preemptions)
        yield InfoMetricFamily("fdserve_attention_path", "What the decode step runs",
                               value={"path": stats.attention_path})
        yield InfoMetricFamily("fdserve_decode_path", "How decode steps run (graphs, scheduling)",
                               value={"path": stats.decode_path})
        yield CounterMetricFamily("fdserve_decode_graph_steps", "Decode steps replayed from a CUDA graph",
                                  value=stats.num_graph_steps)
        counters = CounterMetricFamily("fdserve_attention", "The attention path's own counters",
                                       labels=["counter"])
        for name, value in sorted(stats.attention_counters.items()):
            counters.add_metric([name], float(value))
        yield counters
        failures = CounterMetricFamily("fdserve_request_internal_errors",
                                       "Requests ended by an internal error in the engine, by the stage that failed",
                                       labels=["stage"])
        for stage, count in sorted(stats.internal_errors.items()):
            failures.add_metric([stage], float(count))
        yield failures


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fdserve_requests", "Requests answered, by route and HTTP status",
                                ["route", "status"], registry=r)
        self.finished = Counter("fdserve_request_finish", "Finished choices by finish_reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("fdserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("fdserve_generation_tokens", "Tokens generated", registry=r)
        self.in_flight = Gauge("fdserve_requests_in_flight", "Requests being generated now", registry=r)
        self.ttft = Histogram("fdserve_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("fdserve_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("fdserve_inter_token_latency_seconds", "Time between successive outputs of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("fdserve_e2e_request_latency_seconds", "Arrival to last output",
                             buckets=_E2E_BUCKETS, registry=r)
        self.server_errors = Counter("fdserve_server_internal_errors",
                                     "Requests answered 500 by an unexpected error in the HTTP layer, by exception",
                                     ["exception"], registry=r)
        self.engine_starts = Counter("fdserve_engine_starts", "Engines started (loaded) by this process", registry=r)
        self.engine_exits = Counter("fdserve_engine_exits",
                                    "Engines stopped, by reason (shutdown, or the failure that ended the engine)",
                                    ["reason"], registry=r)
        r.register(_EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
