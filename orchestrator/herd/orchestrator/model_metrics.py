"""One model's metric children, resolved once per model instead of once per request.

``labels(...)`` validates the label values and takes a lock on every call; the gateway records five
to seven metrics per request, so it keeps each model's children here. Prometheus itself keeps every
child it ever created, so caching them adds no growth beyond its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram

from herd.orchestrator.telemetry import Telemetry

__all__ = ["ModelMetrics"]


@dataclass(eq=False)
class ModelMetrics:
    """The per-model children of ``Telemetry``'s metrics, for one served model name."""

    telemetry: Telemetry
    model: str
    in_flight: Gauge = field(init=False)
    decision: Histogram = field(init=False)
    cache_hit_blocks: Histogram = field(init=False)
    ttft: Histogram = field(init=False)
    e2e: Histogram = field(init=False)
    retries: Counter = field(init=False)
    _finished: dict[tuple[str, int], tuple[Counter, Counter | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        telemetry, model = self.telemetry, self.model
        self.in_flight = telemetry.in_flight.labels(model)
        self.decision = telemetry.decision.labels(model)
        self.cache_hit_blocks = telemetry.cache_hit_blocks.labels(model)
        self.ttft = telemetry.ttft.labels(model)
        self.e2e = telemetry.e2e.labels(model)
        self.retries = telemetry.retries.labels(model)

    def count_finished(self, worker_id: str, status: int) -> None:
        """One answered request: ``requests`` by worker and status, and ``errors`` for 4xx and 5xx."""
        counters = self._finished.get((worker_id, status))
        if counters is None:
            errors = self.telemetry.errors.labels(self.model, str(status)) if status >= 400 else None
            requests = self.telemetry.requests.labels(self.model, worker_id, str(status))
            counters = self._finished[worker_id, status] = (requests, errors)
        requests, errors = counters
        requests.inc()
        if errors is not None:
            errors.inc()
