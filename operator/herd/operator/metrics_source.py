"""Worker metrics for the autoscaler: scrape ``/metrics`` of Ready pods, turn two scrapes into figures.

Each Ready pod of the pool is scraped at ``http://<podIP>:<container port named http>/metrics``
(Prometheus text, parsed with ``prometheus_client.parser``). Latency p95s come from histogram bucket
deltas between a pod's previous scrape and this one, summed over pods and interpolated within the
bucket as PromQL's ``histogram_quantile`` does; a counter that went down (the pod restarted) counts
from zero. Queue depth is the sum over pods, KV usage the mean.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from herd.api import metrics as names
from herd.operator.autoscale import Observation

__all__ = [
    "Buckets",
    "Scrape",
    "bucket_deltas",
    "metrics_url",
    "observe",
    "parse_scrape",
    "quantile",
    "scrape_all",
]

Buckets = tuple[tuple[float, float], ...]
"""A histogram as ``(upper bound, cumulative count)`` pairs, sorted by bound, ending with +Inf."""

_HISTOGRAMS = (names.TIME_TO_FIRST_TOKEN_SECONDS, names.INTER_TOKEN_LATENCY_SECONDS)
_GAUGES = (names.NUM_REQUESTS_WAITING, names.KV_CACHE_USAGE_PERC)
_OPTIONAL_GAUGES = (names.NUM_REQUESTS_RUNNING,)
"""Read when a worker exports them; a scrape without them is still complete."""
T = TypeVar("T")


@dataclass(frozen=True)
class Scrape:
    """One pod's answer: the histograms and gauges the autoscaler reads, summed over label sets."""

    histograms: Mapping[str, Buckets]
    gauges: Mapping[str, float]

    @property
    def is_complete(self) -> bool:
        return all(name in self.histograms for name in _HISTOGRAMS) and all(
            name in self.gauges for name in _GAUGES
        )


def parse_scrape(text: str) -> Scrape:
    """The autoscaler's metrics out of a Prometheus text body; a family with no samples yet is empty."""
    histograms: dict[str, Buckets] = {}
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in _HISTOGRAMS:
            counts: dict[float, float] = {}
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    counts[bound] = counts.get(bound, 0.0) + sample.value
            histograms[family.name] = tuple(sorted(counts.items()))
        elif family.name in _GAUGES or family.name in _OPTIONAL_GAUGES:
            gauges[family.name] = sum(sample.value for sample in family.samples)
    return Scrape(histograms, gauges)


def bucket_deltas(before: Buckets, after: Buckets) -> Buckets:
    """What was observed between two scrapes; a reset counter (a restarted pod) counts from zero."""
    previous = dict(before)
    if any(count < previous.get(bound, 0.0) for bound, count in after):
        return after
    return tuple((bound, count - previous.get(bound, 0.0)) for bound, count in after)


def quantile(q: float, histograms: Sequence[Buckets]) -> float | None:
    """``histogram_quantile(q, sum(...))``: linear within the bucket; None without observations."""
    summed: dict[float, float] = {}
    for buckets in histograms:
        for bound, count in buckets:
            summed[bound] = summed.get(bound, 0.0) + count
    cumulative = sorted(summed.items())
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower  # above the highest finite bound: that bound is all we know
            return lower + (bound - lower) * (rank - below) / (count - below)  # below < rank <= count
        lower, below = bound, count
    return lower


def observe(previous: Mapping[str, Scrape], current: Mapping[str, Scrape | None]) -> Observation:
    """The pool's figures from this round's scrapes (by pod name) and each pod's previous scrape.

    Incomplete when there is no Ready pod at all: a pool whose pods all fail is not an idle pool.
    """
    answered = {pod: scrape for pod, scrape in current.items() if scrape is not None}
    compared = {pod: scrape for pod, scrape in answered.items() if pod in previous}
    is_complete = (
        bool(current)
        and len(compared) == len(current)
        and all(scrape.is_complete and previous[pod].is_complete for pod, scrape in compared.items())
    )
    p95 = {
        name: quantile(0.95, [_delta(previous[pod], scrape, name) for pod, scrape in compared.items()])
        for name in _HISTOGRAMS
    }
    kv = [scrape.gauges.get(names.KV_CACHE_USAGE_PERC, 0.0) for scrape in answered.values()]
    return Observation(
        ttft_p95_ms=_ms(p95[names.TIME_TO_FIRST_TOKEN_SECONDS]),
        itl_p95_ms=_ms(p95[names.INTER_TOKEN_LATENCY_SECONDS]),
        num_waiting=sum(s.gauges.get(names.NUM_REQUESTS_WAITING, 0.0) for s in answered.values()),
        kv_usage=sum(kv) / len(kv) if kv else 0.0,
        is_complete=is_complete,
        num_running=sum(s.gauges.get(names.NUM_REQUESTS_RUNNING, 0.0) for s in answered.values()),
    )


def metrics_url(pod: Mapping[str, object]) -> str | None:
    """``http://<podIP>:<port named http>/metrics``, or None while the pod has no IP or no such port."""
    status = pod.get("status")
    spec = pod.get("spec")
    ip = status.get("podIP") if isinstance(status, dict) else None
    containers = spec.get("containers", []) if isinstance(spec, dict) else []
    ports = [port for c in containers for port in c.get("ports") or [] if port.get("name") == "http"]
    if not ip or not ports:
        return None
    return f"http://{ip}:{ports[0]['containerPort']}/metrics"


async def scrape_all(
    http: httpx.AsyncClient, urls: Mapping[str, str | None], parse: Callable[[str], T]
) -> dict[str, T | None]:
    """Scrape every pod at once (``parse_scrape`` for workers, ``parse_demand`` for orchestrators); a
    pod that fails, times out or answers garbage maps to None."""
    pods = list(urls)
    results = await asyncio.gather(*(_scrape(http, urls[pod], parse) for pod in pods))
    return dict(zip(pods, results, strict=True))


async def _scrape(http: httpx.AsyncClient, url: str | None, parse: Callable[[str], T]) -> T | None:
    if url is None:
        return None
    try:
        response = await http.get(url)
        response.raise_for_status()
        return parse(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def _delta(before: Scrape, after: Scrape, name: str) -> Buckets:
    return bucket_deltas(before.histograms.get(name, ()), after.histograms.get(name, ()))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0
