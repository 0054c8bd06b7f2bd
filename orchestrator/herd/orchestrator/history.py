"""The dashboard's history: per model, a point every few seconds over the last minutes (pure, no I/O).

The sampler hands ``History.add`` a ``Snapshot`` of cumulative figures: the orchestrator's requests
per worker and TTFT histogram, and each worker's own prefix-cache counters and inter-token-latency
histogram. ``add`` compares the new snapshot with the newest one at least ``window_seconds`` older (or
the oldest kept, while the window fills) and appends one ``Point``: per model the request rate and
each worker's share of requests, TTFT and ITL p50/p99, and the prefix-cache hit rate over that window.
Points live in a ring buffer of ``num_points``; snapshots only as long as the window needs them.

Counters follow Prometheus' rules, so workers may come, go and restart: a value that went down (a
restarted worker) counts from zero. A series absent from the older snapshot counts from zero if it is
the orchestrator's own (its counters are created at zero on their first use, often mid-window), and is
left out of that window if it is a worker's (cumulative since the worker started: a worker that just
came, or whose scrape failed). Percentiles interpolate within histogram buckets as
Prometheus' ``histogram_quantile`` does. The cost is one pass over the series per sample.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

__all__ = ["Buckets", "History", "ModelPoint", "Point", "Series", "Snapshot", "point_between", "quantile"]

Series = tuple[str, str]
"""(model, worker id)."""
Buckets = Mapping[float, float]
"""A histogram: each upper bound (``le``, ``math.inf`` included) to its cumulative count."""
_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Cumulative figures at one moment; ``ttft`` is per model, keyed ``(model, "")``."""

    at: float
    """Monotonic seconds: what windows are measured in."""
    wall: float
    """Unix seconds: the page's time axis."""
    requests: Mapping[Series, float] = field(default_factory=dict)
    cache_queries: Mapping[Series, float] = field(default_factory=dict)
    cache_hits: Mapping[Series, float] = field(default_factory=dict)
    ttft: Mapping[Series, Buckets] = field(default_factory=dict)
    itl: Mapping[Series, Buckets] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelPoint:
    """One model over one window; ``None`` where the window holds no observation."""

    request_rate: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    hit_rate: float | None
    shares: Mapping[str, float]
    """Each worker's share of the model's requests answered in the window (empty without any)."""


@dataclass(frozen=True, slots=True)
class Point:
    wall: float
    window_seconds: float
    models: Mapping[str, ModelPoint]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class History:
    """The last ``num_points`` points, each over a window of about ``window_seconds``."""

    def __init__(self, *, window_seconds: float, num_points: int) -> None:
        self.window_seconds = window_seconds
        self.points: deque[Point] = deque(maxlen=num_points)
        self._snapshots: deque[Snapshot] = deque()

    def add(self, snapshot: Snapshot) -> None:
        # Keep the newest snapshot that is a whole window old: it is the next point's baseline.
        while len(self._snapshots) > 1 and snapshot.at - self._snapshots[1].at >= self.window_seconds:
            self._snapshots.popleft()
        if self._snapshots:
            self.points.append(point_between(self._snapshots[0], snapshot))
        self._snapshots.append(snapshot)

    def since(self, wall: float | None) -> list[Point]:
        """The points newer than ``wall`` (all of them for ``None``), oldest first."""
        return [point for point in self.points if wall is None or point.wall > wall]


def point_between(old: Snapshot, new: Snapshot) -> Point:
    seconds = new.at - old.at
    requests = counter_increases(new.requests, old.requests, starts_at_zero=True)
    hits = counter_increases(new.cache_hits, old.cache_hits)
    queries = counter_increases(new.cache_queries, old.cache_queries)
    ttft = histogram_increases(new.ttft, old.ttft, starts_at_zero=True)
    itl = histogram_increases(new.itl, old.itl)
    models = sorted({model for model, _ in (*new.requests, *new.ttft, *new.itl, *new.cache_queries)})
    return Point(
        wall=round(new.wall, 3),
        window_seconds=round(seconds, 3),
        models={
            model: ModelPoint(
                request_rate=round(sum(_of(model, requests).values()) / seconds, 3),
                **_percentiles_ms("ttft", _sum_buckets(_of(model, ttft).values())),
                **_percentiles_ms("itl", _sum_buckets(_of(model, itl).values())),
                hit_rate=_ratio(sum(_of(model, hits).values()), sum(_of(model, queries).values())),
                shares=_shares(_of(model, requests)),
            )
            for model in models
        },
    )


def counter_increases(
    new: Mapping[_Key, float], old: Mapping[_Key, float], *, starts_at_zero: bool = False
) -> dict[_Key, float]:
    """How much each counter grew; a reset counts from zero. A series missing from ``old`` counts from
    zero if series ``starts_at_zero`` where they appear, else it is left out."""
    baselines = {key: old.get(key, 0.0) for key in new} if starts_at_zero else old
    return {
        key: value if value < baselines[key] else value - baselines[key]
        for key, value in new.items()
        if key in baselines
    }


def histogram_increases(
    new: Mapping[_Key, Buckets], old: Mapping[_Key, Buckets], *, starts_at_zero: bool = False
) -> dict[_Key, Buckets]:
    """Each histogram's observations since ``old``, with the same rules as ``counter_increases``."""
    baselines = {key: old.get(key, {}) for key in new} if starts_at_zero else old
    return {
        key: _bucket_increases(buckets, baselines[key]) for key, buckets in new.items() if key in baselines
    }


def _bucket_increases(new: Buckets, old: Buckets) -> Buckets:
    if new.get(math.inf, 0.0) < old.get(math.inf, 0.0):
        return new  # the worker restarted: everything it counts is new
    return {bound: count - old.get(bound, 0.0) for bound, count in new.items()}


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' ``histogram_quantile``: linear within the bucket that holds rank ``q * count``; the
    highest finite bound when that is the ``+Inf`` bucket; ``None`` without observations."""
    bounds = sorted(buckets)
    cumulative = _monotonic([buckets[bound] for bound in bounds])
    if not cumulative or cumulative[-1] <= 0:
        return None
    rank = q * cumulative[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, cumulative, strict=True):
        if count >= rank and count > below:
            return lower if math.isinf(bound) else lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _monotonic(counts: list[float]) -> list[float]:
    """Cumulative counts never fall; a sum over workers whose scrapes raced may, so take the running max."""
    running, fixed = 0.0, []
    for count in counts:
        running = max(running, count)
        fixed.append(running)
    return fixed


def _sum_buckets(histograms: Iterable[Buckets]) -> Buckets:
    """Histograms summed bound by bound (Prometheus' ``sum by (le)``)."""
    total: dict[float, float] = {}
    for buckets in histograms:
        for bound, count in buckets.items():
            total[bound] = total.get(bound, 0.0) + count
    return total


def _percentiles_ms(name: str, buckets: Buckets) -> dict[str, float | None]:
    return {f"{name}_p{q}_ms": _ms(quantile(q / 100, buckets)) for q in (50, 99)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole > 0 else None


def _shares(requests: Mapping[str, float]) -> dict[str, float]:
    total = sum(requests.values())
    return {worker: round(count / total, 4) for worker, count in sorted(requests.items())} if total else {}


def _of(model: str, values: Mapping[Series, _Value]) -> dict[str, _Value]:
    """One model's series, by worker id."""
    return {worker: value for (name, worker), value in values.items() if name == model}
