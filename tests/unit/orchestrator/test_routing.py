"""The simple strategies' rules, health filtering and build_strategy."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
from pydantic import TypeAdapter
from support.routing_views import context, views

from herd.api.crd import RoutingSpec
from herd.orchestrator import routing
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.routing import (
    KVCacheAware,
    LeastRequest,
    PrefixHash,
    RandomChoice,
    RoundRobin,
    RoutingStrategy,
    StickySession,
    WorkerView,
    base,
    build_strategy,
    healthy,
)
from herd.orchestrator.routing._load import bounded_load_cap


def _build(strategy: str, **fields: object) -> RoutingStrategy:
    spec = TypeAdapter(RoutingSpec).validate_python({"strategy": strategy, **fields})
    return build_strategy(spec, kv_index=KVIndex(), block_size=16, rng=random.Random(7))


def _ids(strategy: RoutingStrategy, workers: list[WorkerView], count: int) -> list[str]:
    picks = [strategy.select(workers, context()) for _ in range(count)]
    return [pick.id for pick in picks if pick is not None]


@pytest.mark.parametrize(
    ("strategy", "cls", "needs_tokens", "pins_sessions"),
    [
        ("round_robin", RoundRobin, False, False),
        ("least_request", LeastRequest, False, False),
        ("random", RandomChoice, False, False),
        ("prefix_hash", PrefixHash, True, False),
        ("sticky_session", StickySession, False, True),
        ("kv_cache_aware", KVCacheAware, True, False),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_build_strategy_covers_every_spec(
    strategy: str, cls: type[RoutingStrategy], needs_tokens: bool, pins_sessions: bool
) -> None:
    built = _build(strategy)
    assert type(built) is cls
    assert built.name == strategy
    assert (built.needs_tokens, built.pins_sessions) == (needs_tokens, pins_sessions)
    assert built.select(views("w1", "w2"), context()) is not None


def test_build_strategy_passes_the_spec_fields_on() -> None:
    sticky = _build("sticky_session", sessionHeader="X-Conversation", sessionTtlSeconds=60)
    assert isinstance(sticky, StickySession)
    assert (sticky.session_header, sticky.session_ttl_seconds) == ("X-Conversation", 60)


def test_healthy_drops_unhealthy_workers() -> None:
    workers = views("a", "b", "c")
    workers[1] = replace(workers[1], is_healthy=False)
    assert [worker.id for worker in healthy(workers)] == ["a", "c"]


def test_round_robin_cycles_in_id_order_whatever_the_input_order() -> None:
    assert _ids(RoundRobin(), views("c", "a", "b"), 7) == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_keeps_its_place_when_workers_join_or_leave() -> None:
    strategy = RoundRobin()
    assert _ids(strategy, views("a", "c"), 2) == ["a", "c"]
    assert _ids(strategy, views("a", "b", "c", "d"), 3) == ["d", "a", "b"]
    assert _ids(strategy, views("a", "d"), 2) == ["d", "a"]


@pytest.mark.parametrize(
    ("in_flight", "allowed"),
    [
        ({"a": 3, "b": 1, "c": 2}, {"b"}),
        ({"a": 0, "b": 5, "c": 0}, {"a", "c"}),
        ({"a": 2, "b": 2, "c": 2}, {"a", "b", "c"}),
    ],
    ids=["fewest-wins", "tie-between-two", "all-tied"],
)
def test_least_request_picks_the_fewest_in_flight(in_flight: dict[str, int], allowed: set[str]) -> None:
    picks = Counter(_ids(LeastRequest(random.Random(1)), views("a", "b", "c", **in_flight), 60))
    assert set(picks) == allowed


def test_random_reaches_every_worker_and_nothing_else() -> None:
    picks = Counter(_ids(RandomChoice(random.Random(3)), views("a", "b", "c", "d"), 400))
    assert set(picks) == {"a", "b", "c", "d"}
    assert min(picks.values()) > 50


@pytest.mark.parametrize(
    ("session_key", "pin", "workers", "expected"),
    [
        ("s1", "b", ("a", "b", "c"), ["b", "b", "b"]),
        ("s1", "dead", ("a", "b", "c"), ["a", "b", "c"]),
        ("s1", None, ("a", "b", "c"), ["a", "b", "c"]),
        (None, "b", ("a", "b", "c"), ["a", "b", "c"]),
    ],
    ids=["pinned-worker-alive", "pinned-worker-dead-round-robin", "new-session-round-robin", "no-header"],
)
def test_sticky_session_rule(
    session_key: str | None, pin: str | None, workers: tuple[str, ...], expected: list[str]
) -> None:
    strategy = StickySession(session_header="X-Session-ID", session_ttl_seconds=60)
    ctx = context(session_key=session_key, pinned_worker_id=pin)
    picks = [strategy.select(views(*workers), ctx) for _ in expected]
    assert [pick.id for pick in picks if pick is not None] == expected


def test_sticky_session_repins_when_the_pinned_worker_dies() -> None:
    strategy = StickySession(session_header="X-Session-ID", session_ttl_seconds=60)
    pins = {"s1": "a", "s2": "b", "s3": "c"}
    survivors = views("a", "c")
    chosen = {
        session: strategy.select(survivors, context(session_key=session, pinned_worker_id=pin))
        for session, pin in pins.items()
    }
    assert {session: worker.id for session, worker in chosen.items() if worker} == {
        "s1": "a",
        "s2": "a",
        "s3": "c",
    }


def test_the_routing_package_exports_the_shared_interface() -> None:
    assert set(base.__all__) == {
        "PeerPull",
        "Phase",
        "RequestContext",
        "RoutingStrategy",
        "WorkerView",
        "build_strategy",
        "healthy",
        "pull_block_tokens",
        "restore_block_tokens",
    }
    assert set(base.__all__) <= set(routing.__all__)
    assert all(getattr(routing, name) is getattr(base, name) for name in base.__all__)


@pytest.mark.parametrize(
    ("in_flight", "expected"),
    [([0] * 32, 2), ([1] + [0] * 31, 2), ([4] * 8, 6), ([0] * 8, 2), ([2, 2], 4)],
    ids=["idle-fleet-floor", "one-request-on-32-floor", "busy-fleet-paper-bound", "idle-8", "two-workers"],
)
def test_the_bounded_load_cap_has_a_floor_of_two(in_flight: list[int], expected: int) -> None:
    workers = [
        replace(worker, num_in_flight=count)
        for worker, count in zip(
            views(*(f"w{number}" for number in range(len(in_flight)))), in_flight, strict=True
        )
    ]
    assert bounded_load_cap(workers, 1.25) == expected
