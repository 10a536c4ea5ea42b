"""`lily serve`'s /metrics: Prometheus counters, gauges and histograms of the scheduler.

Design choices:
- prometheus-client (the reference implementation of the exposition format) keeps the numbers
  and writes the text; lily only decides what to count. Each server gets its own
  CollectorRegistry, never the process-wide default one: several servers in one process (the
  tests start some) would otherwise clash on metric names or add up each other's requests.
- The scheduler reports events through the small interface of lily.scheduler.SchedulerMetrics
  (a job queued, rejected, started, a token emitted, a job finished), where the numbers arise;
  this module implements it. The scheduler does not import prometheus_client, so the engine
  side stays free of the server extra.
- The queue depth is read from the scheduler's queue when scraped (a gauge with a function),
  so it can never be left stale by two threads setting it out of order. The running count is
  set by the worker, its only writer.
- No tokens/s gauge: ``rate(lily_generation_tokens_total[1m])`` is that, over the window the
  query chooses, and the counter is updated per token, so the rate follows a long generation.
- Time to first token and latency are measured from the moment a request is queued (after
  validation and tokenizing), as a client would see them: queueing time included.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from lily.scheduler import OUTCOMES, SchedulerMetrics

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class PrometheusMetrics(SchedulerMetrics):
    """The scheduler's events as lily_* metrics in a registry of their own."""

    def __init__(self, queue_depth: Callable[[], int]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.queue_depth = Gauge("lily_queue_depth", "Requests waiting in the queue", registry=r)
        self.queue_depth.set_function(queue_depth)
        self.running = Gauge("lily_running_requests",
                             "Requests generating now (the running batch size)", registry=r)
        self.prompt_tokens = Counter("lily_prompt_tokens", "Prompt tokens of the requests that ran "
                                     "(cached ones included; usage.prompt_tokens)", registry=r)
        self.generation_tokens = Counter("lily_generation_tokens", "Generated tokens, all choices "
                                         "(usage.completion_tokens)", registry=r)
        self.cache_hit_tokens = Counter("lily_prompt_cache_hit_tokens", "Prompt tokens served by the "
                                        "prompt cache, not prefilled (usage...cached_tokens)", registry=r)
        self.cache_hit_requests = Counter("lily_prompt_cache_hit_requests",
                                          "Requests that reused at least one cached prompt token", registry=r)
        self.requests = Counter("lily_requests", "Requests by outcome: completed, cancelled (client gone, "
                                "slow reader, shutdown), failed (engine error), rejected (queue full)",
                                ["outcome"], registry=r)
        for outcome in OUTCOMES:  # every series exists from the start, at 0
            self.requests.labels(outcome)
        self.ttft = Histogram("lily_time_to_first_token_seconds", "From queued to the first generated "
                              "chunk (queueing and prefill included)", buckets=TTFT_BUCKETS, registry=r)
        self.latency = Histogram("lily_request_latency_seconds", "From queued to the last chunk, completed "
                                 "requests", buckets=LATENCY_BUCKETS, registry=r)

    def exposition(self) -> bytes:
        """The registry in the text format, version 0.0.4 (CONTENT_TYPE)."""
        return generate_latest(self.registry)

    # -- SchedulerMetrics ----------------------------------------------------------------------

    def set_running(self, n: int) -> None:
        self.running.set(n)

    def started(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        if cached_tokens > 0:
            self.cache_hit_tokens.inc(cached_tokens)
            self.cache_hit_requests.inc()

    def first_chunk(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def token(self) -> None:
        self.generation_tokens.inc()

    def finished(self, outcome: str, seconds: float | None = None) -> None:
        self.requests.labels(outcome).inc()
        if outcome == "completed" and seconds is not None:
            self.latency.observe(seconds)
