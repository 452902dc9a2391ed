"""Prometheus metrics: what the server measures per request, plus the engine's own counters read at scrape time."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector:
    """Engine gauges and counters, taken from `stats()` when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], object]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        gauges = {
            "ds4_num_requests_running": ("Requests holding a cache slot", s.num_running),
            "ds4_num_requests_waiting": ("Requests queued for a cache slot", s.num_waiting),
            "ds4_cache_usage_ratio": ("Fraction of cache pages in use", s.cache_usage),
            "ds4_cache_capacity_tokens": ("Tokens the cache can hold", s.capacity_tokens),
            "ds4_prefix_cache_pages": ("Pages kept by the prefix cache (held or reclaimable)", s.num_cached_pages),
            "ds4_prefix_cache_hit_rate": (
                "Prompt tokens taken from the prefix cache / prompt tokens of admitted requests, since start",
                s.prefix_cache_hit_rate,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "ds4_num_preemptions": ("Requests preempted (cache full) since start", s.num_preemptions),
            "ds4_prompt_tokens": ("Prompt tokens run through the model since start", s.prompt_tokens),
            "ds4_generation_tokens": ("Tokens generated since start", s.generation_tokens),
            "ds4_prefix_cache_queries": (
                "Prompt tokens of admitted requests (prefix cache lookups)",
                s.prefix_cache_queried_tokens,
            ),
            "ds4_prefix_cache_hits": ("Prompt tokens taken from the prefix cache", s.prefix_cache_hit_tokens),
            "ds4_prefix_cache_evictions": ("Cached pages evicted to make room", s.prefix_cache_evicted_pages),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        if getattr(s, "spec_decode", None) is not None:
            yield from _spec_decode_metrics(s.spec_decode)


def _spec_decode_metrics(spec):
    """Speculative decoding (ds4.engine.speculative.SpecDecodeStats); a draft is one verification of one request."""
    counters = {
        "ds4_spec_decode_num_drafts": ("Draft windows verified since start", spec.num_drafts),
        "ds4_spec_decode_num_draft_tokens": ("Draft tokens proposed since start", spec.num_draft_tokens),
        "ds4_spec_decode_num_accepted_tokens": ("Draft tokens accepted since start", spec.num_accepted_tokens),
    }
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(name, doc, value=value)
    yield GaugeMetricFamily(
        "ds4_spec_decode_mean_acceptance_length",
        "Tokens per verification step: 1 + accepted drafts per draft window",
        value=spec.mean_acceptance_length,
    )
    per_position = CounterMetricFamily(
        "ds4_spec_decode_num_accepted_tokens_per_pos",
        "Draft windows whose j-th token was accepted",
        labels=["position"],
    )
    rates = GaugeMetricFamily(
        "ds4_spec_decode_acceptance_rate",
        "Fraction of draft windows whose j-th token was accepted",
        labels=["position"],
    )
    for j, (count, rate) in enumerate(zip(spec.accepted_per_position, spec.acceptance_rates())):
        per_position.add_metric([str(j)], count)
        rates.add_metric([str(j)], rate)
    yield per_position
    yield rates


class ServerMetrics:
    """One registry per server, so several servers (tests) can live in one process."""

    def __init__(self, engine_stats: Callable[[], object]):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ds4_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.finished = Counter(
            "ds4_request_finished", "Generation requests by finish reason", ["finish_reason"], registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "ds4_time_to_first_token_seconds",
            "Arrival to first output token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "ds4_inter_token_latency_seconds",
            "Time between output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "ds4_e2e_request_latency_seconds",
            "Arrival to last output token",
            buckets=_REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.request_prompt_tokens = Counter(
            "ds4_request_prompt_tokens", "Prompt tokens of served requests", registry=self.registry
        )
        self.request_generation_tokens = Counter(
            "ds4_request_generation_tokens", "Output tokens of served requests", registry=self.registry
        )
        self.registry.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
