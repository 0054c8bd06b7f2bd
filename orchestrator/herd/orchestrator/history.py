"""The dashboard's history: per model, a point every few seconds over the last minutes (pure, no I/O).

The sampler hands ``History.add`` a ``Snapshot`` of cumulative figures: the orchestrator's requests
per worker and TTFT histogram, and each worker's own prefix-cache counters and inter-token-latency
histogram. ``add`` compares the new snapshot with the newest one at least ``window_seconds`` older (or
the oldest kept, while the window fills) and appends one ``Point``: per model the request rate and
each worker's share of requests, TTFT and ITL p50/p99, the prefix-cache hit rate, and per KV tier
(``device``, ``host``, ``disk``) its mean usage and the blocks stored into it, restored from it (its
hits) and evicted from it a second, and the peer pulls a second by outcome, over that window.
Points live in a ring buffer of ``num_points``; snapshots only as long as the window needs them.

Counters follow Prometheus' rules, so workers may come, go and restart: a value that went down (a
restarted worker) counts from zero. A series absent from the older snapshot counts from zero if it is
the orchestrator's own (its counters are created at zero on their first use, often mid-window), and
from its first sample in the window if it is a worker's (cumulative since the worker started: a worker
that just came, or whose scrape failed; a worker sampled only once in the window is left out of it);
a worker's tier or pull counter that first shows on a worker sampled before counts from zero (the
worker exposes it from its first count on). Percentiles interpolate within histogram buckets as
Prometheus' ``histogram_quantile`` does. The cost is one pass over the series of the window's
snapshots per sample (7 at the sampler's defaults).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

__all__ = [
    "Buckets",
    "History",
    "ModelPoint",
    "Point",
    "Series",
    "Snapshot",
    "TierPoint",
    "TierSeries",
    "point_between",
    "quantile",
]

Series = tuple[str, str]
"""(model, worker id)."""
TierSeries = tuple[str, str, str]
"""(model, worker id, name): a tier counter's name is ``<stored|restored|evicted>:<medium>`` or
``pulls:<outcome>``; a usage gauge's is the medium."""
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
    tier_counters: Mapping[TierSeries, float] = field(default_factory=dict)
    tier_usage: Mapping[TierSeries, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TierPoint:
    """One KV tier of one model over one window: its mean usage over the workers that report it, and
    blocks a second moved into it, restored from it onto the device (its hits) and evicted from it."""

    usage: float | None
    stored_per_s: float
    restored_per_s: float
    evicted_per_s: float


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
    tiers: Mapping[str, TierPoint] = field(default_factory=dict)
    """Per medium, for the tiers the workers report (empty without tier metrics)."""
    pulls_per_s: Mapping[str, float] = field(default_factory=dict)
    """Peer pulls a second by outcome (``pulled``, ``empty``, ``failed``)."""


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
            self.points.append(point_between(_baseline(self._snapshots), snapshot))
        self._snapshots.append(snapshot)

    def since(self, wall: float | None) -> list[Point]:
        """The points newer than ``wall`` (all of them for ``None``), oldest first."""
        return [point for point in self.points if wall is None or point.wall > wall]


def _baseline(snapshots: Iterable[Snapshot]) -> Snapshot:
    """The oldest snapshot, with each worker series it lacks at its first value in a later one: a
    worker that came (or whose scrape failed) in the window counts from its first sample there, so a
    new worker shows after two samples, not a whole window. A tier series that first appears on a
    worker sampled before it started at zero (see ``_tier_baseline``)."""
    oldest, *later = snapshots
    tiers, sampled = dict(oldest.tier_counters), set(oldest.cache_queries)
    for snapshot in later:
        tiers = _tier_baseline(tiers, snapshot.tier_counters, sampled)
        sampled.update(snapshot.cache_queries)
    return replace(
        oldest,
        cache_queries=_first_values(oldest.cache_queries, [s.cache_queries for s in later]),
        cache_hits=_first_values(oldest.cache_hits, [s.cache_hits for s in later]),
        itl=_first_values(oldest.itl, [s.itl for s in later]),
        tier_counters=tiers,
    )


def _tier_baseline(
    old: Mapping[TierSeries, float], new: Mapping[TierSeries, float], sampled: set[Series]
) -> dict[TierSeries, float]:
    """``old`` with each series of ``new`` it lacks: at zero if its worker was ``sampled`` without it
    (a worker exposes a tier's counter, or a pull outcome's, from its first count on), else at its
    value in ``new`` (a worker not sampled before: its counters are cumulative from an unknown start)."""
    baseline = dict(old)
    for (model, worker, name), value in new.items():
        baseline.setdefault((model, worker, name), 0.0 if (model, worker) in sampled else value)
    return baseline


def _first_values(
    oldest: Mapping[_Key, _Value], later: Iterable[Mapping[_Key, _Value]]
) -> dict[_Key, _Value]:
    first = dict(oldest)
    for values in later:
        for key, value in values.items():
            first.setdefault(key, value)
    return first


def point_between(old: Snapshot, new: Snapshot) -> Point:
    seconds = new.at - old.at
    requests = counter_increases(new.requests, old.requests, starts_at_zero=True)
    hits = counter_increases(new.cache_hits, old.cache_hits)
    queries = counter_increases(new.cache_queries, old.cache_queries)
    ttft = histogram_increases(new.ttft, old.ttft, starts_at_zero=True)
    itl = histogram_increases(new.itl, old.itl)
    tier_baseline = _tier_baseline(old.tier_counters, new.tier_counters, set(old.cache_queries))
    tier_counts = counter_increases(new.tier_counters, tier_baseline)
    series = (*new.requests, *new.ttft, *new.itl, *new.cache_queries, *new.tier_counters, *new.tier_usage)
    models = sorted({model for model, *_ in series})
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
                tiers=_tiers(_per_name(model, tier_counts), _per_name(model, new.tier_usage), seconds),
                pulls_per_s=_pulls(_per_name(model, tier_counts), seconds),
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


def _per_name(model: str, values: Mapping[TierSeries, float]) -> dict[str, list[float]]:
    """One model's tier series, the workers' values listed per name."""
    grouped: dict[str, list[float]] = {}
    for (name, _, key), value in values.items():
        if name == model:
            grouped.setdefault(key, []).append(value)
    return grouped


def _tiers(
    counts: Mapping[str, list[float]], usage: Mapping[str, list[float]], seconds: float
) -> dict[str, TierPoint]:
    media = sorted({*usage, *(key.split(":", 1)[1] for key in counts if not key.startswith("pulls:"))})

    def rate(kind: str, medium: str) -> float:
        return round(sum(counts.get(f"{kind}:{medium}", ())) / seconds, 3)

    return {
        medium: TierPoint(
            usage=round(sum(usage[medium]) / len(usage[medium]), 4) if usage.get(medium) else None,
            stored_per_s=rate("stored", medium),
            restored_per_s=rate("restored", medium),
            evicted_per_s=rate("evicted", medium),
        )
        for medium in media
    }


def _pulls(counts: Mapping[str, list[float]], seconds: float) -> dict[str, float]:
    return {
        key.removeprefix("pulls:"): round(sum(values) / seconds, 3)
        for key, values in sorted(counts.items())
        if key.startswith("pulls:")
    }


def _of(model: str, values: Mapping[Series, _Value]) -> dict[str, _Value]:
    """One model's series, by worker id."""
    return {worker: value for (name, worker), value in values.items() if name == model}
