"""A worker's prefix-cache and inter-token-latency metrics under vLLM's names, and its KV tier and
peer pull metrics under herd's, rendered by the same library the worker uses, for fake workers'
``/metrics`` (``FakeWorker.metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from herd.api import metrics as names

__all__ = ["EngineMetrics"]


class EngineMetrics:
    """Counters and histograms labelled ``model_name`` plus ``labels``; ``text()`` is the page."""

    def __init__(self, *labels: str) -> None:
        self.registry = CollectorRegistry()
        label_names = ["model_name", *labels]
        self.queries = self._counter(names.PREFIX_CACHE_QUERIES, label_names)
        self.hits = self._counter(names.PREFIX_CACHE_HITS, label_names)
        self.itl = Histogram(
            names.INTER_TOKEN_LATENCY_SECONDS,
            "ITL.",
            label_names,
            buckets=(0.01, 0.1),
            registry=self.registry,
        )
        self.ttft = Histogram(names.TIME_TO_FIRST_TOKEN_SECONDS, "TTFT.", label_names, registry=self.registry)
        by_medium = [*label_names, "medium"]
        self.device_usage = Gauge(names.KV_CACHE_USAGE_PERC, "usage", label_names, registry=self.registry)
        self.tier_usage = Gauge(names.HERD_KV_TIER_USAGE_PERC, "usage", by_medium, registry=self.registry)
        self.stored = self._counter(names.HERD_KV_TIER_STORED_TOTAL, by_medium)
        self.restored = self._counter(names.HERD_KV_TIER_RESTORED_TOTAL, by_medium)
        self.evicted = self._counter(names.HERD_KV_TIER_EVICTED_TOTAL, by_medium)
        self.pulls = self._counter(names.HERD_KV_PEER_PULLS_TOTAL, [*label_names, "outcome"])

    def _counter(self, name: str, label_names: list[str]) -> Counter:
        return Counter(name, name, label_names, registry=self.registry)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
