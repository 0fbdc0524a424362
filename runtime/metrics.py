"""``GET /metrics``: the server's counters in Prometheus' text format, through prometheus_client.

Requests by route and status and their latency (counted by :class:`CountRequests`, an ASGI
middleware, so refused and failed requests count too), prompt and generated tokens, and the
engine's state read at each scrape: prompt tokens computed and taken from slots that held them,
requests waiting, sequences decoding, the last step's batch, decode tokens per second over the
last few seconds, free sequence slots.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from runtime.engine import Engine

disable_created_metrics()  # no *_created series: a scrape shows what a dashboard plots

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics")


class _EngineState(Collector):
    """The engine's gauges, read when Prometheus scrapes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        e = self.engine
        yield CounterMetricFamily("picc_decoded_tokens", "Tokens the engine decoded, cancelled sequences' included",
                                  value=e.stats.generated_tokens)
        yield CounterMetricFamily("picc_engine_requests", "Requests the engine accepted", value=e.stats.requests)
        yield CounterMetricFamily("picc_prompt_tokens_computed", "Prompt tokens the engine ran through the model",
                                  value=e.stats.prompt_tokens)
        yield CounterMetricFamily("picc_prompt_tokens_cached", "Prompt tokens whose KV rows the engine took from "
                                  "a slot that held them (a prefix another prompt had run)",
                                  value=e.stats.cached_tokens)
        for name, doc, value in (
            ("picc_queue_depth", "Requests waiting for a sequence slot", e.waiting),
            ("picc_active_sequences", "Sequences prefilling or decoding", e.active),
            ("picc_batch_size", "Sequences that decoded in the engine's last step", e.stats.batch),
            ("picc_max_batch", "Sequences the engine decodes at once (--max-batch)", e.max_batch),
            ("picc_free_slots", "Sequence slots (KV caches) free", e.pool.free),
            ("picc_decode_tokens_per_second", "Tokens decoded per second, all sequences, last 5 s",
             e.stats.rate(time.perf_counter())),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    """The server's registry and the counters its handlers update."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("picc_requests", "HTTP requests by route and status", ("route", "status"),
                                registry=self.registry)
        self.latency = Histogram("picc_request_duration_seconds", "Time from request to its last byte",
                                 ("route",), registry=self.registry,
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.prompt_tokens = Counter("picc_prompt_tokens", "Prompt tokens of completed requests",
                                     registry=self.registry)
        self.generated_tokens = Counter("picc_generated_tokens", "Tokens generated for completed requests",
                                        registry=self.registry)
        self.registry.register(_EngineState(engine))

    def finished(self, prompt_tokens: int, generated: int) -> None:
        """A request's tokens, when it ends (its latency is CountRequests')."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CountRequests:
    """ASGI middleware: each HTTP request's route (one of :data:`ROUTES`, else ``other``), status
    and duration into ``metrics``."""

    def __init__(self, app, metrics: Metrics) -> None:  # noqa: ANN001 - an ASGI app
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = next((r for r in ROUTES if path == r or (r == "/v1/models" and path.startswith(r + "/"))), "other")
        status, start = [500], time.perf_counter()

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.requests.labels(route, str(status[0])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - start)
