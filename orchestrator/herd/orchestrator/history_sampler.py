"""Feeds the dashboard's ``History``: every few seconds, one ``Snapshot`` from the orchestrator's own
metrics and each healthy worker's ``/metrics`` (the edge: ``herd.orchestrator.history`` is pure).

The orchestrator sees TTFT and which worker answered; inter-token latency and realized prefix-cache
hits only the workers know, under vLLM's metric names that every backend exposes. A scrape is one GET
per worker per interval with a short timeout and bounded concurrency, and only the lines of the three
samples used are read (about 35 us for a herd worker's page, which takes it 0.5 ms to render). The
scrapes of one point are spread over the first half of the interval, each worker at its own offset,
as Prometheus spreads its targets: a fleet of hundreds is never asked at the same instant (each
worker's counters are still read once a point, at the same phase, so their rates stay exact). A
worker whose scrape fails is left out of the windows it misses (see ``History``).
"""

from __future__ import annotations

import asyncio
import logging
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
_WANTED = (_QUERIES, _HITS, _ITL)
_LE = re.compile(r'[{,]le="([^"]*)"')


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


@dataclass(frozen=True, slots=True)
class WorkerFigures:
    """What one worker's ``/metrics`` says about its prefix cache and inter-token latency."""

    cache_queries: float = 0.0
    cache_hits: float = 0.0
    itl: dict[float, float] = field(default_factory=dict)


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
        return figures

    def _note_failure(self, worker_id: str, reason: str) -> None:
        if worker_id not in self._failing:  # once per outage, not every interval
            self._failing.add(worker_id)
            log.warning(
                "worker metrics scrape failed: the dashboard history leaves the worker's hit rate and "
                "inter-token latency out until its /metrics answers; check the worker's /metrics",
                extra={"worker": worker_id, "reason": reason},
            )


def parse_worker_metrics(text: str) -> WorkerFigures:
    """The prefix-cache counters and ITL histogram in a Prometheus text page, summed over its series.

    Only the lines of those three samples are read, by hand: prometheus_client's parser took 305 us for
    a herd worker's page against 35 us, and the page is scraped from every worker every interval."""
    queries = hits = 0.0
    itl: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        name, value = _sample(line)
        if name == _QUERIES:
            queries += value
        elif name == _HITS:
            hits += value
        elif name == _ITL and (bound := _LE.search(line)) is not None:
            le = float(bound.group(1))  # "+Inf" parses as math.inf
            itl[le] = itl.get(le, 0.0) + value
    return WorkerFigures(cache_queries=queries, cache_hits=hits, itl=itl)


def _sample(line: str) -> tuple[str, float]:
    """A sample line's name and value (``name{labels} value [timestamp]``); ``ValueError`` if malformed."""
    name = line.split("{", 1)[0].split(" ", 1)[0]
    rest = line[line.rindex("}") + 1 :] if "{" in line else line[len(name) :]
    return name, float(rest.split()[0])


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
