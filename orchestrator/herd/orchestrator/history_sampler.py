"""Feeds the dashboard's ``History``: every few seconds, one ``Snapshot`` from the orchestrator's own
metrics and each healthy worker's ``/metrics`` (the edge: ``herd.orchestrator.history`` is pure).

The orchestrator sees TTFT and which worker answered; inter-token latency and realized prefix-cache
hits only the workers know, under vLLM's metric names that every backend exposes, and the KV tiers'
usage, stores, restores and evictions and the peer pulls under herd's own (a worker without tiers has
only its device's). A scrape is one GET per worker per interval with a short timeout and bounded
concurrency, and only the lines of the samples used are read (about 90 us for a herd worker's page
with a host tier, 160 lines, on a busy 2-core machine). The scrapes of one point are spread over the
first half of the interval, each worker at its own offset, as Prometheus spreads its targets: a fleet
of hundreds is never asked at the same instant (each worker's counters are still read once a point, at
the same phase, so their rates stay exact). A worker whose scrape fails counts again from its next
sample (see ``History``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client import Counter, Histogram
from prometheus_client.samples import Sample

from herd.api import metrics as names
from herd.orchestrator.discovery import WorkerEndpoint
from herd.orchestrator.history import History, Series, Snapshot
from herd.orchestrator.registry import Registry, WorkerState
from herd.orchestrator.telemetry import Telemetry

__all__ = [
    "HistorySampler",
    "HistorySettings",
    "counter_totals",
    "parse_worker_metrics",
    "requests_by_worker",
]

log = logging.getLogger(__name__)

_QUERIES = names.PREFIX_CACHE_QUERIES + "_total"
_HITS = names.PREFIX_CACHE_HITS + "_total"
_ITL = names.INTER_TOKEN_LATENCY_SECONDS + "_bucket"
_DEVICE_USAGE = names.KV_CACHE_USAGE_PERC
_TIER_USAGE = names.HERD_KV_TIER_USAGE_PERC
_TIER_COUNTERS = {
    names.HERD_KV_TIER_STORED_TOTAL: "stored",
    names.HERD_KV_TIER_RESTORED_TOTAL: "restored",
    names.HERD_KV_TIER_EVICTED_TOTAL: "evicted",
}
_PULLS = names.HERD_KV_PEER_PULLS_TOTAL
_WANTED = (_QUERIES, _HITS, _ITL, _DEVICE_USAGE, _TIER_USAGE, _PULLS, *_TIER_COUNTERS)
_LE = re.compile(r'[{,]le="([^"]*)"')
_MEDIUM = re.compile(r'[{,]medium="([^"]*)"')
_OUTCOME = re.compile(r'[{,]outcome="([^"]*)"')


@dataclass(frozen=True, slots=True)
class HistorySettings:
    interval_seconds: float = 5.0
    """How often a point is taken."""
    window_seconds: float = 30.0
    """What each point covers: rates and percentiles over the last ``window_seconds``."""
    span_seconds: float = 900.0
    """How far back the page can look (the ring buffer holds ``span / interval`` points)."""
    scrape_timeout_seconds: float = 1.0
    max_concurrent_scrapes: int = 16


@dataclass(slots=True)
class WorkerFigures:
    """What one worker's ``/metrics`` says about its prefix cache, inter-token latency and KV tiers."""

    cache_queries: float = 0.0
    cache_hits: float = 0.0
    itl: dict[float, float] = field(default_factory=dict)
    tier_counters: dict[str, float] = field(default_factory=dict)
    """``<stored|restored|evicted>:<medium>`` and ``pulls:<outcome>`` totals (``TierSeries``' names)."""
    tier_usage: dict[str, float] = field(default_factory=dict)
    """Each medium's share of blocks in use (``device`` from vLLM's KV cache usage)."""
    num_skipped: int = 0
    """Samples left out: a line without a value, or a value (or ``le``) that is NaN or infinite."""


class HistorySampler:
    """Runs the sampling loop (``run``, cancelled with the app) and holds the ``History`` it fills."""

    def __init__(
        self, registry: Registry, telemetry: Telemetry, http: httpx.AsyncClient, settings: HistorySettings
    ) -> None:
        self.registry, self.telemetry, self.http, self.settings = registry, telemetry, http, settings
        num_points = max(1, round(settings.span_seconds / settings.interval_seconds))
        self.history = History(window_seconds=settings.window_seconds, num_points=num_points)
        self._limit = asyncio.Semaphore(settings.max_concurrent_scrapes)
        self._failing: set[str] = set()
        self._skipping: set[str] = set()

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self.history.add(await self.snapshot())
            except Exception:  # the page loses a point, not its history: the next interval tries again
                log.exception("dashboard history sample failed; the next interval tries again")
            await asyncio.sleep(max(0.0, self.settings.interval_seconds - (time.monotonic() - started)))

    async def snapshot(self) -> Snapshot:
        at, wall = time.monotonic(), time.time()
        counted = counter_totals(self.telemetry.requests, "model", "worker")
        endpoints = [worker.endpoint for worker in self.registry.workers.values()]
        requests = requests_by_worker(counted, endpoints)
        ttft = {
            (model, ""): buckets
            for (model,), buckets in histogram_buckets(self.telemetry.ttft, "model").items()
        }
        healthy = [worker for worker in self.registry.workers.values() if worker.is_healthy]
        gap = self.settings.interval_seconds / 2 / max(1, len(healthy))
        scraped = await asyncio.gather(
            *(self._scrape(worker, delay=number * gap) for number, worker in enumerate(healthy))
        )
        figures = {
            (worker.endpoint.model, worker.endpoint.id): found
            for worker, found in zip(healthy, scraped, strict=True)
            if found is not None
        }
        return Snapshot(
            at,
            wall,
            requests=requests,
            cache_queries={key: found.cache_queries for key, found in figures.items()},
            cache_hits={key: found.cache_hits for key, found in figures.items()},
            ttft=ttft,
            itl={key: found.itl for key, found in figures.items()},
            tier_counters={
                (*key, name): value
                for key, found in figures.items()
                for name, value in found.tier_counters.items()
            },
            tier_usage={
                (*key, medium): value
                for key, found in figures.items()
                for medium, value in found.tier_usage.items()
            },
        )

    async def _scrape(self, worker: WorkerState, *, delay: float) -> WorkerFigures | None:
        worker_id = worker.endpoint.id
        await asyncio.sleep(delay)
        try:
            async with self._limit:
                response = await self.http.get(
                    worker.endpoint.url + "/metrics", timeout=self.settings.scrape_timeout_seconds
                )
            response.raise_for_status()
            figures = parse_worker_metrics(response.text)
        except (httpx.HTTPError, ValueError) as error:
            self._note_failure(worker_id, f"{type(error).__name__}: {error}")
            return None
        if worker_id in self._failing:
            self._failing.discard(worker_id)
            log.info("worker metrics scrape recovered", extra={"worker": worker_id})
        self._note_skipped(worker_id, figures.num_skipped)
        return figures

    def _note_skipped(self, worker_id: str, num_skipped: int) -> None:
        if not num_skipped:
            self._skipping.discard(worker_id)
        elif worker_id not in self._skipping:  # once while it lasts, as _note_failure warns
            self._skipping.add(worker_id)
            log.warning(
                "worker metrics have samples without a value or with a NaN or infinite one: the "
                "dashboard history leaves them out; check what the worker's /metrics serves",
                extra={"worker": worker_id, "num_skipped": num_skipped},
            )

    def _note_failure(self, worker_id: str, reason: str) -> None:
        if worker_id not in self._failing:  # once per outage, not every interval
            self._failing.add(worker_id)
            log.warning(
                "worker metrics scrape failed: the dashboard history leaves the worker's hit rate, "
                "inter-token latency and KV tiers out until its /metrics answers; check the worker's /metrics",
                extra={"worker": worker_id, "reason": reason},
            )


def parse_worker_metrics(text: str) -> WorkerFigures:
    """The prefix-cache counters, ITL histogram and KV tier figures in a Prometheus text page, summed
    over its series.

    Only the lines of those samples are read, by hand: prometheus_client's parser took 20 times as long
    on a herd worker's page (2 ms against 90 us, side by side), and the page is scraped from every
    worker every interval. A sample without a value or with a NaN or infinite one is left out (and
    counted in ``num_skipped``): one such value would poison every rate and percentile of the window;
    ``ValueError`` for a value that is no number."""
    figures = WorkerFigures()
    for line in text.splitlines():
        if line.startswith(_WANTED):
            name, value = _sample(line)
            if value is None or not math.isfinite(value):
                figures.num_skipped += 1
            else:
                _take(figures, line, name, value)
    return figures


def _take(figures: WorkerFigures, line: str, name: str, value: float) -> None:
    """Add one sample line's value to ``figures`` (a bucket whose ``le`` is NaN is skipped)."""
    if name == _QUERIES:
        figures.cache_queries += value
    elif name == _HITS:
        figures.cache_hits += value
    elif name == _ITL and (bound := _LE.search(line)) is not None:
        le = float(bound.group(1))  # "+Inf" parses as math.inf
        if math.isnan(le):
            figures.num_skipped += 1
        else:
            figures.itl[le] = figures.itl.get(le, 0.0) + value
    elif name == _DEVICE_USAGE:
        figures.tier_usage["device"] = value
    elif name == _TIER_USAGE and (medium := _MEDIUM.search(line)) is not None:
        figures.tier_usage[medium.group(1)] = value
    elif name in _TIER_COUNTERS and (medium := _MEDIUM.search(line)) is not None:
        key = f"{_TIER_COUNTERS[name]}:{medium.group(1)}"
        figures.tier_counters[key] = figures.tier_counters.get(key, 0.0) + value
    elif name == _PULLS and (outcome := _OUTCOME.search(line)) is not None:
        key = f"pulls:{outcome.group(1)}"
        figures.tier_counters[key] = figures.tier_counters.get(key, 0.0) + value


def _sample(line: str) -> tuple[str, float | None]:
    """A sample line's name and value (``name{labels} value [timestamp]``), ``None`` for a line without
    a value; ``ValueError`` if the value is no number or a label set is not closed."""
    name = line.split("{", 1)[0].split(" ", 1)[0]
    rest = line[line.rindex("}") + 1 :] if "{" in line else line[len(name) :]
    fields = rest.split()
    return name, float(fields[0]) if fields else None


def requests_by_worker(
    counted: Mapping[tuple[str, ...], float], endpoints: Iterable[WorkerEndpoint]
) -> dict[Series, float]:
    """Requests answered per (model, worker). A known worker that has answered none counts zero, so
    its share shows as zero; a prefill worker is left out, since its requests are counted on the
    decode worker that answers them."""
    known = {(endpoint.model, endpoint.id): 0.0 for endpoint in endpoints if endpoint.role != "prefill"}
    return known | {(model, worker): count for (model, worker), count in counted.items()}


def counter_totals(counter: Counter, *labels: str) -> dict[tuple[str, ...], float]:
    """The counter's value summed per combination of ``labels`` (its samples, not ``_created`` stamps)."""
    totals: dict[tuple[str, ...], float] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                key = tuple(sample.labels[label] for label in labels)
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def histogram_buckets(histogram: Histogram, *labels: str) -> dict[tuple[str, ...], dict[float, float]]:
    """Each child's cumulative buckets, summed per combination of ``labels``."""
    samples = (sample for metric in histogram.collect() for sample in metric.samples)
    return _buckets((sample for sample in samples if sample.name.endswith("_bucket")), labels)


def _buckets(samples: Iterable[Sample], labels: tuple[str, ...]) -> dict[tuple[str, ...], dict[float, float]]:
    """``_bucket`` samples summed bound by bound per combination of ``labels`` (``le`` aside)."""
    grouped: dict[tuple[str, ...], dict[float, float]] = {}
    for sample in samples:
        buckets = grouped.setdefault(tuple(sample.labels[label] for label in labels), {})
        bound = float(sample.labels["le"])  # "+Inf" parses as math.inf
        buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return grouped
