"""Idle headroom: workers kept free of batch work while interactive traffic is recent."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import openai
import pytest
from support.gateway_fakes import FAST_REGISTRY, MODEL, FakeCluster, FakeWorker, running_gateway, wait_for

from herd.api.crd import RoundRobinRouting
from herd.orchestrator.admission.tenants import Tenant
from herd.orchestrator.app import AppSettings
from herd.orchestrator.auth import ApiKeys
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.gateway import GatewaySettings
from herd.orchestrator.routing import RequestContext, UnroutableError, WorkerView, decide
from herd.orchestrator.routing.headroom import Headroom, IdleHeadroom, RecentPeak, kept_idle, serving_pool
from herd.orchestrator.served import ServedModel

BATCH = 1000
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def worker(name: str, batch: int = 0, interactive: int = 0, **fields: object) -> WorkerView:
    return WorkerView(
        id=name,
        url=f"http://{name}",
        num_in_flight=batch + interactive,
        num_background=batch,
        **fields,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("share", "peak", "num_workers", "headroom"),
    [
        (0.25, 2, 8, 2),
        (0.25, 5, 8, 2),
        (0.25, 0, 8, 0),
        (0.25, 2, 2, 1),
        (0.5, 2, 2, 1),
        (0.9, 9, 4, 3),
        (0.25, 2, 1, 0),
        (0.25, 1, 0, 0),
        (0.0, 4, 8, 0),
    ],
    ids=[
        "the-peak",
        "capped-by-the-share",
        "no-interactive-traffic",
        "a-quarter-of-2-rounds-up",
        "half-of-2",
        "never-every-worker",
        "one-worker-is-never-kept",
        "no-worker",
        "off",
    ],
)
def test_workers_to_keep(share: float, peak: int, num_workers: int, headroom: int) -> None:
    assert IdleHeadroom(max_share=share).workers(peak, num_workers) == headroom


@pytest.mark.parametrize(
    ("share", "minimum", "peak", "num_workers", "headroom"),
    [
        (0.25, 2, 0, 8, 2),
        (0.25, 1, 3, 8, 2),
        (0.25, 3, 1, 8, 3),
        (0.0, 2, 5, 8, 2),
        (0.25, 4, 0, 3, 2),
        (0.25, 1, 0, 1, 0),
    ],
    ids=[
        "a-standing-reserve-without-interactive-traffic",
        "the-peak-above-it",
        "above-the-share",
        "the-minimum-alone",
        "never-every-worker",
        "one-worker-is-never-kept",
    ],
)
def test_a_minimum_of_workers_to_keep(
    share: float, minimum: int, peak: int, num_workers: int, headroom: int
) -> None:
    assert IdleHeadroom(max_share=share, min_workers=minimum).workers(peak, num_workers) == headroom


def test_a_negative_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="0 or more workers, got -1"):
        IdleHeadroom(min_workers=-1)


@pytest.mark.parametrize(
    ("views", "headroom", "kept"),
    [
        ([worker("a", 3), worker("b"), worker("c")], 1, {"b"}),
        ([worker("a", 3), worker("b"), worker("c", interactive=1)], 1, {"c"}),
        ([worker("a", 3), worker("b", interactive=1), worker("c", interactive=2)], 2, {"b", "c"}),
        ([worker("a", 3), worker("b"), worker("c", 1)], 1, {"b"}),
        ([worker("a", 1), worker("b", 2), worker("c", 2, interactive=1)], 1, {"a"}),
        ([worker("a", 3), worker("b", 2), worker("c", 2, interactive=1)], 1, {"c"}),
        ([worker("a", 3), worker("b", 2), worker("c", 2)], 2, {"b", "c"}),
        ([worker("a", 3), worker("b"), worker("c", 1)], 2, {"b", "c"}),
        ([worker("a", 3), worker("b"), worker("c", 1)], 0, set()),
    ],
    ids=[
        "a-free-one-by-id",
        "the-free-one-with-interactive-work",
        "the-most-interactive-work",
        "a-worker-with-batch-work-is-not-kept-while-one-is-free",
        "none-free-drains-the-least-batch-work",
        "then-the-most-interactive-work",
        "none-free-drains-two",
        "short-by-one-keeps-the-free-and-drains-one",
        "no-headroom",
    ],
)
def test_kept_idle(views: list[WorkerView], headroom: int, kept: set[str]) -> None:
    assert kept_idle(views, headroom) == kept


@pytest.mark.parametrize(
    ("views", "headroom", "before", "kept"),
    [
        ([worker("a"), worker("b"), worker("c", 3)], 1, {"b"}, {"b"}),
        ([worker("a", interactive=2), worker("b"), worker("c", 3)], 1, {"b"}, {"b"}),
        ([worker("a", 2), worker("b", 2), worker("c", 3)], 1, {"b"}, {"b"}),
        ([worker("a"), worker("b", 1), worker("c", 3)], 1, {"b"}, {"a"}),
        ([worker("a", 1), worker("c", 3)], 1, {"b"}, {"a"}),
        ([worker("a"), worker("b"), worker("c")], 1, {"a", "c"}, {"a"}),
        ([worker("a"), worker("b"), worker("c")], 2, {"c"}, {"a", "c"}),
        ([worker("a"), worker("b"), worker("c")], 0, {"c"}, set()),
    ],
    ids=[
        "a-kept-worker-stays-before-a-free-one-with-a-lower-id",
        "before-a-free-one-with-more-interactive-work",
        "before-one-holding-as-much-batch-work",
        "gives-its-place-to-one-holding-less-batch-work",
        "one-that-left-the-pool-is-replaced",
        "a-shrinking-headroom-keeps-the-first-of-the-kept",
        "a-growing-headroom-keeps-the-kept-and-adds",
        "no-headroom",
    ],
)
def test_kept_idle_holds_still(
    views: list[WorkerView], headroom: int, before: set[str], kept: set[str]
) -> None:
    """The kept set changes only where a worker holding less batch work, the pool or the count asks."""
    assert kept_idle(views, headroom, kept_before=frozenset(before)) == kept


def plain_kept_idle(views: list[WorkerView], headroom: int, kept_before: frozenset[str]) -> set[str]:
    """The rule as it reads: every worker ranked by (background work, not kept before, background
    work less requests in flight, id), the first ``headroom``."""
    ranked = sorted(
        views,
        key=lambda v: (v.num_background, v.id not in kept_before, v.num_background - v.num_in_flight, v.id),
    )
    return {view.id for view in ranked[: max(headroom, 0)]}


@pytest.mark.parametrize("seed", range(40))
def test_kept_idle_keeps_what_the_plain_rule_keeps(seed: int) -> None:
    """``kept_idle`` ranks only the workers tied at the bar; on random fleets (few distinct loads, so
    ties abound, other replicas' requests in flight too) it keeps exactly what ranking all of them does."""
    rng = random.Random(seed)
    num_workers = rng.choice([1, 2, 5, 20, 200])
    views = [
        worker(
            f"w{rng.randrange(10_000):04d}-{i}",
            batch=rng.choice([0, 0, 0, 1, 2, 3]),
            interactive=rng.choice([0, 0, 1, 2]),
        )
        for i in range(num_workers)
    ]
    views = [replace(v, num_in_flight=v.num_in_flight + rng.choice([0, 0, 1])) for v in views]
    for _ in range(5):
        headroom = rng.randrange(-1, num_workers + 2)
        before = frozenset(v.id for v in rng.sample(views, rng.randrange(num_workers + 1)))
        assert kept_idle(views, headroom, before) == plain_kept_idle(views, headroom, before)
        # The set held still (the previous decision's), and the same with one of it gone from the pool.
        kept = plain_kept_idle(views, headroom, before)
        for held in (kept, frozenset(sorted(kept)[1:]) | {"gone"}):
            assert kept_idle(views, headroom, held) == plain_kept_idle(views, headroom, held)


def test_headroom_holds_its_kept_workers_between_decisions() -> None:
    """A batch line's decision keeps the set of the one before while the kept workers hold no more
    batch work than the others; an interactive decision is bound by none and leaves the set as it is."""
    headroom = Headroom(IdleHeadroom(max_share=0.0, min_workers=1))
    assert headroom.kept({BATCH: 2}, [worker("a", 1), worker("b"), worker("c", 1)], BATCH, 0.0) == {"b"}
    # a drained: free as b, with a lower id; b stays kept.
    assert headroom.kept({BATCH: 1}, [worker("a"), worker("b"), worker("c", 1)], BATCH, 1.0) == {"b"}
    assert headroom.kept({BATCH: 1, 0: 1}, [worker("a", 1), worker("b", interactive=1)], 0, 2.0) == set()
    assert headroom.kept(
        {BATCH: 3}, [worker("a", 1), worker("b", is_healthy=False), worker("c", 2)], BATCH, 3.0
    ) == {"a"}
    assert (
        Headroom(IdleHeadroom(max_share=0.0)).kept({BATCH: 1}, [worker("a"), worker("b")], BATCH, 0.0)
        == set()
    )


def test_the_recent_peak_forgets_what_left_the_window() -> None:
    peak = RecentPeak(window_s=10.0)
    assert peak.peak(0.0) == 0
    for now, value in [(0.0, 3), (1.0, 1), (2.0, 2), (5.0, 1)]:
        peak.observe(value, now)
    assert [peak.peak(now) for now in (5.0, 10.0, 11.0, 12.5, 15.0, 16.0)] == [3, 3, 2, 1, 1, 0]


def test_headroom_counts_interactive_requests_and_binds_background_ones() -> None:
    headroom = Headroom(IdleHeadroom(max_share=0.5, window_s=10.0))
    fleet = [worker(n, 4) for n in "abcd"]
    batch_only, one_interactive = {BATCH: 16}, {BATCH: 16, 0: 1}
    assert (
        headroom.workers(batch_only, len(fleet), BATCH, 0.0) == 0
    )  # no interactive traffic: the batch fills it
    assert headroom.workers(one_interactive, len(fleet), BATCH, 0.0) == 1  # the one in flight now
    assert headroom.workers(one_interactive, len(fleet), 0, 1.0) == 0  # observed: 1 in flight and itself
    assert headroom.workers(one_interactive, len(fleet), BATCH, 8.0) == 2  # the peak, recent
    assert headroom.workers(batch_only, len(fleet), BATCH, 17.0) == 1  # ended, but in flight at 8.0
    assert headroom.workers(batch_only, len(fleet), BATCH, 18.5) == 0
    # The share is of the serving pool: healthy workers, not a prefill pool (half of 2 here).
    pools = [worker("a", 4), worker("b", 4, is_healthy=False), worker("c", 4), worker("p", role="prefill")]
    assert [view.id for view in serving_pool(pools)] == ["a", "c"]
    assert headroom.workers({BATCH: 12, 0: 3}, len(serving_pool(pools)), BATCH, 30.0) == 1
    standing = Headroom(IdleHeadroom(max_share=0.0, min_workers=1))
    assert standing.workers(batch_only, len(fleet), BATCH, 0.0) == 1  # kept without interactive traffic
    assert (
        standing.workers(one_interactive, len(fleet), 0, 0.0) == 0
    )  # the rule binds background requests only


def served(limit: int) -> ServedModel:
    return ServedModel(
        ModelConfig("m", RoundRobinRouting(strategy="round_robin"), max_in_flight_per_worker=limit)
    )


def test_decide_keeps_batch_lines_off_the_headroom_workers() -> None:
    """Batch lines keep off the kept workers, a retried one too (its worker failed it) while another
    may serve it; one whose every other worker is excluded takes a kept one rather than wait at its
    queue's head for the window to end."""
    fleet = [worker("a", 3), worker("b", interactive=1), worker("c"), worker("d", 1)]
    batch = RequestContext(model="m", priority=BATCH)
    model = served(8)
    assert {decide(model, fleet, batch, kept=frozenset("b")).worker.id for _ in range(6)} == {"a", "c", "d"}
    assert {decide(model, fleet, batch, kept=frozenset("bc")).worker.id for _ in range(6)} == {"a", "d"}
    interactive = RequestContext(model="m", priority=0)
    assert decide(served(8), fleet, interactive, kept=frozenset("b")).worker.id in "abc"
    retry = RequestContext(model="m", priority=BATCH, excluded=frozenset({"a"}))
    assert (
        decide(
            served(8), [worker("a"), worker("b", interactive=1), worker("c", 1)], retry, kept=frozenset("b")
        ).worker.id
        == "c"
    )
    assert (
        decide(served(8), [worker("a"), worker("b", interactive=1)], retry, kept=frozenset("b")).worker.id
        == "b"
    )
    full = [worker("a", 6), worker("b")]
    with pytest.raises(UnroutableError) as refused:
        decide(served(8), full, batch, kept=frozenset("b"))  # the slot reserve holds a's last slots
    assert refused.value.reason == "at_capacity"
    assert decide(served(8), full, batch).worker.id == "b"


LINE_URL = "/v1/chat/completions"
KEYS = ApiKeys.of_tenants([("k", Tenant(name="team"))])


async def run_batch(api: openai.AsyncOpenAI, name: str, num_lines: int) -> None:
    lines = [
        {
            "custom_id": f"{name}-{n}",
            "method": "POST",
            "url": LINE_URL,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "user": f"{name}-{n}"},
        }
        for n in range(num_lines)
    ]
    content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    upload = await api.files.create(file=("in.jsonl", content), purpose="batch")
    batch = await api.batches.create(input_file_id=upload.id, endpoint=LINE_URL, completion_window="24h")
    for _ in range(400):
        batch = await api.batches.retrieve(batch.id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            break
        await asyncio.sleep(0.025)
    assert batch.status == "completed" and batch.request_counts is not None
    assert batch.request_counts.completed == num_lines


def takers(cluster: FakeCluster, name: str) -> set[str]:
    """The workers that served a line of the batch ``name``."""
    return {
        worker.id
        for worker in cluster.workers
        for body in worker.bodies
        if str(body["user"]).startswith(name)
    }


async def test_batch_lines_keep_off_a_worker_while_interactive_traffic_is_recent(tmp_path: Path) -> None:
    """Three workers, an interactive stream on one: the batch's lines keep off it while the stream
    is in flight and for the window after (the recent peak, 1 worker), and take it once that passed."""
    cluster = FakeCluster([FakeWorker(f"w{n}", chunk_delay=0.1, num_chunks=12) for n in range(3)])
    window = 3.0
    gateway = GatewaySettings(idle_headroom=IdleHeadroom(max_share=0.5, window_s=window))
    settings = AppSettings(registry=FAST_REGISTRY, batch_dir=tmp_path, gateway=gateway)
    async with running_gateway(cluster, settings=settings, api_keys=KEYS) as (_, client):
        api = openai.AsyncOpenAI(
            api_key="k", base_url="http://orchestrator/v1", http_client=client, max_retries=0
        )
        body = {**CHAT, "stream": True, "user": "interactive"}
        interactive = asyncio.create_task(
            client.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer k"})
        )
        await wait_for(lambda: takers(cluster, "interactive") != set())
        (kept,) = takers(cluster, "interactive")
        await run_batch(api, "during", 12)
        others = {worker.id for worker in cluster.workers} - {kept}
        assert not interactive.done() and takers(cluster, "during") == others
        assert (await interactive).status_code == 200
        ended = time.monotonic()
        await run_batch(api, "after", 6)
        assert time.monotonic() - ended < window and kept not in takers(cluster, "after")
        await asyncio.sleep(window)
        await run_batch(api, "later", 6)
    assert takers(cluster, "later") == {"w0", "w1", "w2"}


async def test_a_standing_reserve_keeps_a_worker_off_the_batch_without_interactive_traffic(
    tmp_path: Path,
) -> None:
    """``min_workers`` 1 on three workers and no interactive request: the batch's lines use two of
    them, the same two throughout (the kept one is chosen by id among the batch-free ones)."""
    cluster = FakeCluster([FakeWorker(f"w{n}", chunk_delay=0.05, num_chunks=4) for n in range(3)])
    gateway = GatewaySettings(idle_headroom=IdleHeadroom(max_share=0.0, min_workers=1))
    settings = AppSettings(registry=FAST_REGISTRY, batch_dir=tmp_path, gateway=gateway)
    async with running_gateway(cluster, settings=settings, api_keys=KEYS) as (_, client):
        api = openai.AsyncOpenAI(
            api_key="k", base_url="http://orchestrator/v1", http_client=client, max_retries=0
        )
        await run_batch(api, "standing", 12)
    assert len(takers(cluster, "standing")) == 2
