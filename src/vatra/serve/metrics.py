"""The server's Prometheus metrics, in a registry of their own (one per app)."""

from __future__ import annotations

from typing import Any

from vatra._extras import require

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServeMetrics:
    """Per-variant request, row and error counts, latency and batch-size histograms, swaps."""

    def __init__(self) -> None:
        pc = require("prometheus_client", "serve", "the /metrics endpoint")
        self._pc = pc
        self.registry = pc.CollectorRegistry()
        r = self.registry
        self.requests = pc.Counter(
            "vatra_serve_requests", "Prediction requests answered, by variant", ["variant"], registry=r
        )
        self.rows = pc.Counter("vatra_serve_rows", "Rows scored, by variant", ["variant"], registry=r)
        self.errors = pc.Counter(
            "vatra_serve_errors",
            "Prediction requests that failed, by variant and kind (input: 4xx, model: 5xx)",
            ["variant", "kind"],
            registry=r,
        )
        self.rejected = pc.Counter(
            "vatra_serve_rejected", "Requests refused before routing, by status", ["status"], registry=r
        )
        self.latency = pc.Histogram(
            "vatra_serve_latency_seconds",
            "Time from request to answer, by variant",
            ["variant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_rows = pc.Histogram(
            "vatra_serve_batch_rows", "Rows per model call", ["variant"], buckets=_ROWS_BUCKETS, registry=r
        )
        self.batch_requests = pc.Histogram(
            "vatra_serve_batch_requests",
            "Requests per model call",
            ["variant"],
            buckets=_ROWS_BUCKETS,
            registry=r,
        )
        self.model_seconds = pc.Histogram(
            "vatra_serve_model_seconds",
            "Time of one model call, by variant",
            ["variant"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.swaps = pc.Counter("vatra_serve_swaps", "Hot swaps, by variant", ["variant"], registry=r)
        self.version = pc.Gauge(
            "vatra_serve_version", "1 for the version each variant serves", ["variant", "version"], registry=r
        )
        self.outcomes = pc.Counter("vatra_serve_outcomes", "Outcomes logged", registry=r)

    def observer(self, variant: str) -> Any:
        """The batcher's per-call callback for ``variant``."""

        def observe(requests: int, rows: int, seconds: float) -> None:
            self.batch_requests.labels(variant).observe(requests)
            self.batch_rows.labels(variant).observe(rows)
            self.model_seconds.labels(variant).observe(seconds)

        return observe

    def swapped(self, variant: str, old: str, new: str) -> None:
        self.version.remove(variant, old)
        self.version.labels(variant, new).set(1)
        self.swaps.labels(variant).inc()

    def render(self) -> tuple[bytes, str]:
        return self._pc.generate_latest(self.registry), self._pc.CONTENT_TYPE_LATEST
