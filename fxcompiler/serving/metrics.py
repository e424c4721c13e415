"""Prometheus metrics of the server (vLLM's names under the ``fxcompiler:`` prefix), in a private registry."""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine import RequestMetrics

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _EngineCollector:
    """Gauges and counters read from the engine at scrape time (no background sampling)."""

    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str):
        self.stats, self.model = stats, model_name

    def collect(self):
        s = self.stats()
        lab = ["model_name"]
        for name, key, doc in (("num_requests_running", "num_running", "Requests being processed."),
                               ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
                               ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache blocks in use (0..1)."),
                               ("prefix_cache_hit_rate", None, "Prompt tokens served from the prefix cache.")):
            value = s[key] if key else (s["prefix_cache_hits"] / s["prefix_cache_queries"]
                                        if s["prefix_cache_queries"] else 0.0)
            g = GaugeMetricFamily(f"fxcompiler:{name}", doc, labels=lab)
            g.add_metric([self.model], value)
            yield g
        for name, key, doc in (("prompt_tokens", "prompt_tokens", "Prefilled prompt tokens."),
                               ("generation_tokens", "generation_tokens", "Generated tokens."),
                               ("num_preemptions", "num_preemptions", "Sequences preempted."),
                               ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up."),
                               ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found cached."),
                               ("spec_decode_num_drafts", "spec_decode_num_drafts",
                                "Speculative decoding: drafts verified (one per sequence and verify step)."),
                               ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens",
                                "Speculative decoding: draft tokens verified."),
                               ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
                                "Speculative decoding: draft tokens accepted.")):
            c = CounterMetricFamily(f"fxcompiler:{name}", doc, labels=lab)
            c.add_metric([self.model], s[key])
            yield c


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str):
        self.registry = CollectorRegistry()
        self.model = model_name
        self.registry.register(_EngineCollector(stats, model_name))
        lab = ["model_name"]
        self.ttft = Histogram("fxcompiler:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("fxcompiler:time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", lab, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("fxcompiler:e2e_request_latency_seconds", "End-to-end request latency.", lab,
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.success = Counter("fxcompiler:request_success_total", "Finished requests by finish reason.",
                               lab + ["finished_reason"], registry=self.registry)
        for h in (self.ttft, self.tpot, self.e2e):
            h.labels(self.model)  # exported (empty) from the start
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(self.model, reason)

    def observe(self, m: RequestMetrics) -> None:
        """Called once per request when its stream ends (finished or aborted)."""
        self.success.labels(self.model, m.finish_reason or "unknown").inc()
        if m.first_token is None:
            return
        self.ttft.labels(self.model).observe(m.first_token - m.arrival)
        if m.last_token is not None and m.num_generation_tokens > 1:
            self.tpot.labels(self.model).observe((m.last_token - m.first_token) / (m.num_generation_tokens - 1))
        if m.finish_reason != "abort" and m.last_token is not None:
            self.e2e.labels(self.model).observe(m.last_token - m.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PoolingMetrics:
    """The metrics of an encoder-model server: requests by outcome, their latency and prompt tokens."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model = model_name
        lab = ["model_name"]
        self.success = Counter("fxcompiler:request_success_total", "Finished requests by finish reason.",
                               lab + ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("fxcompiler:prompt_tokens", "Prompt tokens encoded.", lab,
                                     registry=self.registry)
        self.e2e = Histogram("fxcompiler:e2e_request_latency_seconds", "End-to-end request latency.", lab,
                             buckets=_E2E_BUCKETS, registry=self.registry)
        for reason in ("stop", "error"):
            self.success.labels(self.model, reason)
        self.prompt_tokens.labels(self.model)
        self.e2e.labels(self.model)

    def observe(self, started: float, prompt_tokens: int, reason: str) -> None:
        """One request that started at ``started`` (``time.perf_counter()``) ended: ``stop`` or ``error``."""
        self.success.labels(self.model, reason).inc()
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.e2e.labels(self.model).observe(time.perf_counter() - started)

    def render(self) -> bytes:
        return generate_latest(self.registry)
