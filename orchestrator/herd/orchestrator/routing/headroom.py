"""Idle headroom: workers kept free of background work while interactive traffic is recent.

The slot reserve (``routing.reserve``) keeps slots open on every worker, but a worker that runs batch
lines runs an engine step all the time: an interactive request that lands on it waits for the step
in progress to end (half a step on average, a whole one at worst) before its prefill starts, where
on an idle worker it starts at once. A decode step has a fixed cost (reading the weights), so no
shorter step removes that wait; a worker without background work does. So a background request (at
``SlotReserve.priority`` or a larger number) may not take the headroom's workers: batch-free ones
(those with interactive requests first, where least-loaded routing sends interactive traffic), and
while there are too few of them, the ones holding the least background work, which then drain.

The headroom is the recent peak of interactive requests (more urgent than background) in flight on
the model's workers (``RecentPeak``, over ``IdleHeadroom.window_s``), capped by
``IdleHeadroom.max_share`` of the workers (rounded up) and never all of them: without interactive
traffic there is none and the batch fills the fleet. The adaptive part pays only while interactive
traffic is recent, but it starts when that traffic does, on workers still finishing their batch
lines (a line's length); ``IdleHeadroom.min_workers`` keeps a standing reserve that the first
interactive requests after a quiet spell find idle, paid in batch throughput all the time. The least-loaded strategies send interactive
requests to the batch-free workers, which hold fewer in flight. The cost is the batch's throughput
on those workers, only while interactive traffic is recent.

``kept_idle`` is the rule, pure; the gateway and the endpoint picker each keep ``Headrooms``, a
``Headroom`` a model, which says how many workers to keep and which (``Headroom.kept``, the set held
still between decisions), and ``decide`` keeps background requests off them in its capacity filter,
after the slot reserve.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter

from herd.orchestrator.routing._types import WorkerView
from herd.orchestrator.routing.reserve import DEFAULT_RESERVE, SlotReserve

__all__ = [
    "NO_HEADROOM",
    "Headroom",
    "Headrooms",
    "IdleHeadroom",
    "RecentPeak",
    "kept_idle",
    "serving_pool",
]


@dataclass(frozen=True, slots=True)
class IdleHeadroom:
    max_share: float = 0.25
    """The most of a model's workers kept free of background work, rounded up (0: none)."""
    window_s: float = 10.0
    """How far back the peak of interactive requests in flight is remembered."""
    min_workers: int = 0
    """Workers kept free of background work even without interactive traffic (never every worker)."""

    def __post_init__(self) -> None:
        if self.min_workers < 0:
            raise ValueError(f"the idle headroom's minimum must be 0 or more workers, got {self.min_workers}")
        if not 0.0 <= self.max_share < 1.0:
            raise ValueError(f"the idle headroom's max share must be in [0, 1), got {self.max_share}")
        if self.window_s <= 0:
            raise ValueError(f"the idle headroom's window must be positive, got {self.window_s}")

    @property
    def is_on(self) -> bool:
        return bool(self.max_share or self.min_workers)

    def workers(self, interactive_peak: int, num_workers: int) -> int:
        """The batch-free workers to keep: the interactive peak, at most ``max_share`` of
        ``num_workers`` rounded up, at least ``min_workers``, and never every worker (background work
        always progresses)."""
        adaptive = min(interactive_peak, math.ceil(num_workers * self.max_share))
        return max(0, min(max(adaptive, self.min_workers), num_workers - 1))


NO_HEADROOM = IdleHeadroom(max_share=0.0)


def serving_pool(views: Sequence[WorkerView]) -> list[WorkerView]:
    """The workers of ``views`` that the headroom is a share of: healthy, and not a prefill pool's."""
    return [view for view in views if view.is_healthy and view.role != "prefill"]


_id = attrgetter("id")
_num_background = attrgetter("num_background")
_num_in_flight = attrgetter("num_in_flight")


def kept_idle(
    views: Sequence[WorkerView], headroom: int, kept_before: frozenset[str] = frozenset()
) -> frozenset[str]:
    """The ids of the ``headroom`` workers among ``views`` (the serving pool) that a background
    request may not take: those holding no background work first, the ones with the most interactive
    requests among them first (where interactive traffic already goes); when too few hold none, the
    ones holding the least background work (then the most interactive), so that they drain.

    The set holds still: among workers holding as much background work, those in ``kept_before`` (the
    previous decision's set) come first, so a kept worker gives its place only to one holding less
    background work, or when it leaves the pool or the headroom shrinks. Without that, a worker whose
    batch lines drained (or which took an interactive request) would displace a kept one between two
    decisions, and the next batch line would land on the worker the interactive traffic was sent to.
    Remaining ties: by id.

    That is the order (background work, not kept before, background work less requests in flight,
    id). Every batch line's decision asks, so at 1,000 workers no Python function runs per worker:
    the views carry their background work as a count (``WorkerView.num_background``), sorted whole
    to find the ``headroom``-th least; those holding less are kept, and only those holding exactly
    that much are ranked (among them, more in flight is more interactive work), the kept-before ones
    alone when they fill the rest."""
    if headroom <= 0:
        return frozenset()
    if headroom >= len(views):
        return frozenset(map(_id, views))
    if len(kept_before) == headroom and _hold_none(views, kept_before) == headroom:
        # The common case: the set holds still. Its workers hold no background work, so the bar is
        # 0 and they fill the headroom: the ranking below would keep them (one pass, not five).
        return kept_before
    backgrounds = list(map(_num_background, views))
    bar = sorted(backgrounds)[headroom - 1]
    # Counts are never negative: at a bar of 0 none holds less (the common case, a pass saved).
    kept = list(compress(views, map(operator.gt, repeat(bar), backgrounds))) if bar else []
    tied = list(compress(views, map(operator.eq, backgrounds, repeat(bar))))
    was_kept = list(map(kept_before.__contains__, map(_id, tied)))
    held = list(compress(tied, was_kept))
    room = headroom - len(kept)
    if len(held) >= room:
        kept += _most_in_flight(held, room)
    else:
        others = list(compress(tied, map(operator.not_, was_kept)))
        kept += held + _most_in_flight(others, room - len(held))
    return frozenset(map(_id, kept))


def _hold_none(views: Sequence[WorkerView], ids: frozenset[str]) -> int:
    """How many of ``views`` with an id in ``ids`` hold no background work."""
    return len([view for view in views if view.id in ids and not view.num_background])


def _most_in_flight(views: list[WorkerView], n: int) -> list[WorkerView]:
    """The first ``n`` of ``views`` by requests in flight, most first, then by id (two sorts: a
    stable one keeps the order of the first among equals, where reversed as well); ``views`` itself
    when it has no more than ``n``."""
    if len(views) <= n:
        return views
    return sorted(sorted(views, key=_id), key=_num_in_flight, reverse=True)[:n]


class RecentPeak:
    """The largest value observed over the last ``window_s`` seconds (times from the caller's clock).

    A deque of (time, value) whose values fall from the front: a value older and no larger than a
    newer one can never be the peak again, so observing drops it; the front is the peak once the
    points older than the window are dropped. Amortized O(1) per observation."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._points: deque[tuple[float, int]] = deque()

    def observe(self, value: int, now: float) -> None:
        while self._points and self._points[-1][1] <= value:
            self._points.pop()
        self._points.append((now, value))

    def peak(self, now: float) -> int:
        while self._points and self._points[0][0] < now - self._window_s:
            self._points.popleft()
        return self._points[0][1] if self._points else 0


class Headroom:
    """One model's idle headroom: the recent peak of its interactive requests in flight, how many
    batch-free workers that asks for, and which (``kept``, the last set given, which it holds still).
    The gateway calls ``kept`` before each decision with the model's requests in flight by priority
    (``Registry.in_flight_by_priority``, kept as requests come and go, so an interactive decision
    walks no worker) and the request's priority; an interactive request counts itself in the peak."""

    def __init__(self, settings: IdleHeadroom, reserve: SlotReserve = DEFAULT_RESERVE) -> None:
        self.settings = settings
        self.reserve = reserve
        self.recent = RecentPeak(settings.window_s)
        self._kept: frozenset[str] = frozenset()

    def kept(
        self, in_flight: Mapping[int, int], views: Sequence[WorkerView], priority: int, now: float
    ) -> frozenset[str]:
        """The ids of the workers a request of ``priority`` may not take at ``now`` (``workers`` of
        them, ``kept_idle`` over the serving pool, the previous background decision's set held
        still): none for an interactive request, which leaves the set as it was."""
        is_background = priority >= self.reserve.priority
        serving = serving_pool(views) if is_background and self.settings.is_on else []
        headroom = self.workers(in_flight, len(serving), priority, now)
        if not is_background:
            return frozenset()
        self._kept = kept_idle(serving, headroom, self._kept)
        return self._kept

    def workers(self, in_flight: Mapping[int, int], num_serving: int, priority: int, now: float) -> int:
        """The headroom for a request of ``priority`` at ``now``, ``in_flight`` being the model's
        requests in flight by priority (on its serving workers) and ``num_serving`` the size of its
        serving pool (``serving_pool``; read only for a background request): 0 for an interactive
        request (the rule binds background ones only). Every decision observes the interactive
        requests in flight (an interactive request counts itself), so a long one counts until it
        ends, while the batch's decisions come."""
        if not self.settings.is_on:
            return 0
        interactive = sum(n for p, n in in_flight.items() if p < self.reserve.priority)
        if priority < self.reserve.priority:
            self.recent.observe(interactive + 1, now)
            return 0
        self.recent.observe(interactive, now)
        return self.settings.workers(self.recent.peak(now), num_serving)


class Headrooms:
    """Each model's ``Headroom``, made on its first decision: one set per gateway or endpoint picker."""

    def __init__(self, settings: IdleHeadroom, reserve: SlotReserve = DEFAULT_RESERVE) -> None:
        self.settings = settings
        self.reserve = reserve
        self._models: dict[str, Headroom] = {}

    def kept(
        self, model: str, in_flight: Mapping[int, int], views: Sequence[WorkerView], priority: int, now: float
    ) -> frozenset[str]:
        """``Headroom.kept`` for ``model``."""
        headroom = self._models.get(model)
        if headroom is None:
            headroom = self._models[model] = Headroom(self.settings, self.reserve)
        return headroom.kept(in_flight, views, priority, now)
