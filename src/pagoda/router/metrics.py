"""Prometheus metrics of one router, in its own registry (so several routers can live in one process)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pagoda_router_requests",
            "Requests forwarded to a backend, by the outcome of that attempt (HTTP status, "
            "'connect_error', 'timeout', 'stream_error').",
            ["backend", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "pagoda_router_in_flight_requests", "Requests being served by a backend.", ["backend"], registry=r
        )
        self.retries = Counter(
            "pagoda_router_retries",
            "Requests retried on another backend after failing before the first byte, by the failed backend.",
            ["backend"],
            registry=r,
        )
        self.failovers = Counter(
            "pagoda_router_failovers",
            "Times a backend was taken out of rotation (failed health check or request).",
            ["backend"],
            registry=r,
        )
        self.healthy = Gauge(
            "pagoda_router_backend_healthy",
            "1 if the backend is in rotation, else 0.",
            ["backend"],
            registry=r,
        )
        self.decisions = Counter(
            "pagoda_router_policy_decisions",
            "Routing decisions by policy and reason.",
            ["policy", "reason"],
            registry=r,
        )
        self.latency = Histogram(
            "pagoda_router_request_duration_seconds",
            "Time from receiving a request to sending its last byte, by endpoint.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
