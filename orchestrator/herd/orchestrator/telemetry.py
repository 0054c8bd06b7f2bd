"""The orchestrator's Prometheus metrics (one registry per app) and a short window for the dashboard."""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from herd.api import metrics as names
from herd.api.heap import GC_PAUSES

__all__ = ["RecentRequests", "Telemetry"]

_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True, slots=True)
class _Finished:
    at: float
    ttft_seconds: float | None


class RecentRequests:
    """Requests finished in the last ``window_seconds``: their rate and TTFT median."""

    def __init__(self, window_seconds: float = 30.0) -> None:
        self.window_seconds = window_seconds
        self._items: deque[_Finished] = deque()

    def record(self, ttft_seconds: float | None) -> None:
        self._items.append(_Finished(time.monotonic(), ttft_seconds))
        self._trim()

    def rate_per_second(self) -> float:
        self._trim()
        return len(self._items) / self.window_seconds

    def ttft_p50_ms(self) -> float | None:
        self._trim()
        ttfts = [item.ttft_seconds for item in self._items if item.ttft_seconds is not None]
        return statistics.median(ttfts) * 1000 if ttfts else None

    def _trim(self) -> None:
        horizon = time.monotonic() - self.window_seconds
        while self._items and self._items[0].at < horizon:
            self._items.popleft()


class Telemetry:
    """Every orchestrator metric, registered on this app's own ``CollectorRegistry``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(GC_PAUSES)
        reg = self.registry
        self.requests = Counter(
            names.HERD_ROUTER_REQUESTS_TOTAL,
            "Requests answered.",
            ["model", "worker", "status"],
            registry=reg,
        )
        self.errors = Counter(
            names.HERD_ROUTER_ERRORS_TOTAL, "Failed requests.", ["model", "reason"], registry=reg
        )
        self.retries = Counter(
            names.HERD_ROUTER_RETRIES_TOTAL, "Retries on another worker.", ["model"], registry=reg
        )
        self.resumes = Counter(
            names.HERD_ROUTER_RESUMES_TOTAL,
            "Streams whose worker failed mid-answer, by whether another worker took them over.",
            ["model", "outcome"],
            registry=reg,
        )
        self.decision = Histogram(
            names.HERD_ROUTER_DECISION_SECONDS,
            "Routing decision time.",
            ["model"],
            buckets=_DECISION_BUCKETS,
            registry=reg,
        )
        self.ttft = Histogram(
            names.HERD_ROUTER_TTFT_SECONDS,
            "Time to the first streamed byte.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            names.HERD_ROUTER_E2E_SECONDS,
            "Request latency end to end.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.in_flight = Gauge(names.HERD_ROUTER_IN_FLIGHT, "Requests in flight.", ["model"], registry=reg)
        self.held = Gauge(
            names.HERD_ROUTER_REQUESTS_HELD,
            "Requests held while the model has no ready worker (it scaled to zero): the demand that starts one.",
            ["model"],
            registry=reg,
        )
        self.workers = Gauge(names.HERD_ROUTER_WORKERS, "Workers known.", ["model", "state"], registry=reg)
        self.circuit = Gauge(
            names.HERD_ROUTER_CIRCUIT_STATE,
            "Each worker's circuit breaker: 1 for its current state (closed, open, half_open).",
            ["model", "worker", "state"],
            registry=reg,
        )
        self.restarts = Counter(
            names.HERD_WORKER_RESTARTS_TOTAL,
            "Worker processes seen restarting (a new KV epoch on the same worker).",
            ["model", "worker"],
            registry=reg,
        )
        self.cache_hit_blocks = Histogram(
            names.HERD_ROUTER_CACHE_HIT_BLOCKS,
            "Leading blocks the chosen worker holds (predicted).",
            ["model"],
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=reg,
        )
        self.recent = RecentRequests()
