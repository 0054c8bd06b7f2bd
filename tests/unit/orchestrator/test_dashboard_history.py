"""The dashboard's history: the pure sampler (windows, rates, percentiles, eviction, workers coming and
going) table-driven, then the app's sampling task over fake workers through ``/dashboard/data``."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import httpx
import pytest
from support.engine_metrics import EngineMetrics
from support.gateway_fakes import FAST_REGISTRY, FakeCluster, FakeWorker, running_gateway

from herd.orchestrator.app import AppSettings
from herd.orchestrator.discovery import WorkerEndpoint
from herd.orchestrator.history import (
    Buckets,
    History,
    ModelPoint,
    Snapshot,
    TierPoint,
    TierSeries,
    counter_increases,
    histogram_increases,
    point_between,
    quantile,
)
from herd.orchestrator.history_sampler import (
    HistorySettings,
    WorkerFigures,
    parse_worker_metrics,
    requests_by_worker,
)

INF = math.inf
MODEL = "m"


def snap(
    at: float,
    *,
    requests: Mapping[str, float] | None = None,
    queries: Mapping[str, float] | None = None,
    hits: Mapping[str, float] | None = None,
    ttft: Buckets | None = None,
    itl: Mapping[str, Buckets] | None = None,
) -> Snapshot:
    """A snapshot of model ``m`` at ``at`` seconds (Unix time 1000 s later), per worker id."""

    def of(values: Mapping[str, Any] | None) -> dict[tuple[str, str], Any]:
        return {(MODEL, worker): value for worker, value in (values or {}).items()}

    return Snapshot(
        at,
        1000.0 + at,
        requests=of(requests),
        cache_queries=of(queries),
        cache_hits=of(hits),
        ttft={} if ttft is None else {(MODEL, ""): ttft},
        itl=of(itl),
    )


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, {}, None),
        (0.5, {1.0: 0, INF: 0}, None),
        (0.5, {0.1: 10, INF: 10}, 0.05),
        (0.5, {0.1: 0, 0.2: 10, INF: 10}, 0.15),
        (0.99, {0.1: 50, 1.0: 100, INF: 100}, 0.982),
        (0.5, {0.1: 1, INF: 10}, 0.1),
        (0.5, {0.1: 6, 0.2: 5, INF: 10}, 0.1 * 5 / 6),
    ],
    ids=[
        "no buckets",
        "no observations",
        "inside the first bucket, from zero",
        "interpolated in the bucket holding the rank",
        "p99 across buckets",
        "in the +Inf bucket: the highest finite bound",
        "a falling cumulative count (raced scrapes) is lifted",
    ],
)
def test_quantile_interpolates_like_prometheus(q: float, buckets: Buckets, expected: float | None) -> None:
    found = quantile(q, buckets)
    assert found == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    ("new", "old", "starts_at_zero", "expected"),
    [
        ({"a": 7.0}, {"a": 3.0}, False, {"a": 4.0}),
        ({"a": 2.0}, {"a": 30.0}, False, {"a": 2.0}),
        ({"a": 5.0, "b": 9.0}, {"a": 5.0}, False, {"a": 0.0}),
        ({"a": 5.0, "b": 9.0}, {"a": 5.0}, True, {"a": 0.0, "b": 9.0}),
        ({"a": 5.0}, {"a": 1.0, "b": 9.0}, True, {"a": 4.0}),
    ],
    ids=[
        "grew",
        "reset (a restarted worker) counts from zero",
        "a worker's new series waits a sample",
        "the orchestrator's new series counts from zero",
        "a gone one drops",
    ],
)
def test_counter_increases(
    new: dict[str, float], old: dict[str, float], starts_at_zero: bool, expected: dict[str, float]
) -> None:
    assert counter_increases(new, old, starts_at_zero=starts_at_zero) == expected


@pytest.mark.parametrize(
    ("new", "old", "expected"),
    [
        ({0.1: 4.0, INF: 6.0}, {0.1: 1.0, INF: 2.0}, {0.1: 3.0, INF: 4.0}),
        ({0.1: 1.0, INF: 1.0}, {0.1: 5.0, INF: 8.0}, {0.1: 1.0, INF: 1.0}),
    ],
    ids=["bucket by bucket", "a restart (fewer observations) counts from zero"],
)
def test_histogram_increases(new: Buckets, old: Buckets, expected: Buckets) -> None:
    assert histogram_increases({"w": new}, {"w": old}) == {"w": expected}


def test_a_new_histogram_counts_from_zero_only_if_series_start_there() -> None:
    new = {"w": {0.1: 2.0, INF: 3.0}}
    assert histogram_increases(new, {}, starts_at_zero=True) == new
    assert histogram_increases(new, {}) == {}


NO_TRAFFIC = ModelPoint(0.0, None, None, None, None, None, {})


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            snap(0, requests={"w0": 0, "w1": 0}),
            snap(5, requests={"w0": 15, "w1": 5}),
            replace(NO_TRAFFIC, request_rate=4.0, shares={"w0": 0.75, "w1": 0.25}),
        ),
        (
            snap(0, queries={"w0": 0}, hits={"w0": 0}),
            snap(5, queries={"w0": 10, "w2": 1000}, hits={"w0": 5, "w2": 1000}),
            replace(NO_TRAFFIC, hit_rate=0.5),
        ),
        (
            snap(0),
            snap(5, requests={"w0": 5}, ttft={0.1: 5, INF: 5}),
            replace(NO_TRAFFIC, request_rate=1.0, ttft_p50_ms=50.0, ttft_p99_ms=99.0, shares={"w0": 1.0}),
        ),
        (
            snap(0, requests={"w0": 0, "w1": 3}),
            snap(5, requests={"w0": 4}),
            replace(NO_TRAFFIC, request_rate=0.8, shares={"w0": 1.0}),
        ),
        (
            snap(0, queries={"w0": 100, "w1": 0}, hits={"w0": 50, "w1": 0}),
            snap(5, queries={"w0": 10, "w1": 10}, hits={"w0": 10, "w1": 0}),
            replace(NO_TRAFFIC, hit_rate=0.5),
        ),
        (
            snap(0, requests={"w0": 9}, queries={"w0": 40}, ttft={0.1: 3, INF: 3}),
            snap(5, requests={"w0": 9}, queries={"w0": 40}, ttft={0.1: 3, INF: 3}),
            NO_TRAFFIC,
        ),
        (
            snap(0, ttft={0.1: 0, 1.0: 0, INF: 0}, itl={"w0": {0.01: 0, 0.1: 0, INF: 0}, "w1": {}}),
            snap(
                5,
                ttft={0.1: 50, 1.0: 100, INF: 100},
                itl={"w0": {0.01: 10, 0.1: 10, INF: 10}, "w1": {0.01: 0, 0.1: 10, INF: 10}},
            ),
            replace(NO_TRAFFIC, ttft_p50_ms=100.0, ttft_p99_ms=982.0, itl_p50_ms=10.0, itl_p99_ms=98.2),
        ),
    ],
    ids=[
        "request rate and each worker's share from the request counter",
        "a worker's counters that came (since it started) wait for its second sample",
        "the orchestrator's series count from zero where they first appear",
        "a worker that left drops out",
        "hit rate over the workers' counters, a restarted one from zero",
        "no traffic: no percentiles, no hit rate, no shares",
        "TTFT and ITL p50/p99 from the window's observations, ITL summed over workers",
    ],
)
def test_a_point_over_one_window(old: Snapshot, new: Snapshot, expected: ModelPoint) -> None:
    point = point_between(old, new)
    assert (point.wall, point.window_seconds) == (1005.0, 5.0)
    assert point.models == {MODEL: expected}


def test_a_model_whose_workers_all_left_has_no_point() -> None:
    point = point_between(snap(0, requests={"w0": 1}), Snapshot(5, 1005))
    assert point.models == {}


def steady(num: int, *, every: float = 5.0, rate: float = 1.0) -> list[Snapshot]:
    """``num`` snapshots ``every`` seconds of one worker answering ``rate`` requests a second."""
    return [snap(i * every, requests={"w0": i * every * rate}) for i in range(num)]


@pytest.mark.parametrize(
    ("snapshots", "window", "expected_windows"),
    [
        (steady(1), 30.0, []),
        (steady(10), 30.0, [5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 30.0, 30.0, 30.0]),
        (steady(4), 5.0, [5.0, 5.0, 5.0]),
        ([*steady(3), snap(100, requests={"w0": 100})], 30.0, [5.0, 10.0, 90.0]),
    ],
    ids=[
        "one snapshot: no point yet",
        "the window fills, then slides",
        "a window of one interval",
        "a stalled sampler compares with the last snapshot before the gap",
    ],
)
def test_points_cover_the_window(
    snapshots: list[Snapshot], window: float, expected_windows: list[float]
) -> None:
    history = History(window_seconds=window, num_points=100)
    for snapshot in snapshots:
        history.add(snapshot)
    assert [point.window_seconds for point in history.points] == expected_windows
    assert all(point.models[MODEL].request_rate == 1.0 for point in history.points)


def test_old_points_are_evicted_and_since_returns_the_newer() -> None:
    history = History(window_seconds=30.0, num_points=3)
    for snapshot in steady(7):
        history.add(snapshot)
    assert [point.wall for point in history.points] == [1020.0, 1025.0, 1030.0]
    assert [point.wall for point in history.since(1020.0)] == [1025.0, 1030.0]
    assert history.since(None) == list(history.points)
    assert history.since(1030.0) == []


def test_a_tier_counter_that_appears_on_a_sampled_worker_starts_at_zero() -> None:
    """A worker exposes a tier's counter from its first count on, mid-window too."""
    history = History(window_seconds=30.0, num_points=10)

    def tiers(at: float, counters: dict[TierSeries, float]) -> Snapshot:
        return replace(snap(at, queries={"w0": 0}), tier_counters=counters)

    history.add(tiers(0, {}))
    history.add(tiers(5, {("m", "w0", "stored:host"): 30}))
    history.add(tiers(10, {("m", "w0", "stored:host"): 30, ("m", "w0", "restored:host"): 20}))
    assert [point.models[MODEL].tiers["host"].stored_per_s for point in history.points] == [6.0, 3.0]
    assert [point.models[MODEL].tiers["host"].restored_per_s for point in history.points] == [0.0, 2.0]


def test_a_worker_that_came_mid_window_counts_from_its_first_sample() -> None:
    history = History(window_seconds=30.0, num_points=10)
    history.add(snap(0, queries={"w0": 100}, hits={"w0": 0}))
    history.add(snap(5, queries={"w0": 100, "w1": 500}, hits={"w0": 0, "w1": 400}))  # w1 came
    history.add(snap(10, queries={"w0": 200, "w1": 600}, hits={"w0": 50, "w1": 500}))
    assert [point.models[MODEL].hit_rate for point in history.points] == [None, 0.75]  # w0 0.5, w1 1.0


def test_worker_metrics_are_summed_over_their_series_and_the_rest_ignored() -> None:
    engine = EngineMetrics("engine")
    for label, queries, hits, gaps in (("0", 100, 60, (0.005, 0.05)), ("1", 20, 20, (0.5,))):
        engine.queries.labels("tiny", label).inc(queries)
        engine.hits.labels("tiny", label).inc(hits)
        engine.ttft.labels("tiny", label).observe(0.2)
        for gap in gaps:
            engine.itl.labels("tiny", label).observe(gap)
    figures = parse_worker_metrics(engine.text())
    assert figures == WorkerFigures(cache_queries=120, cache_hits=80, itl={0.01: 1, 0.1: 2, INF: 3})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("# nothing here\nother_metric 1\nvllm:prefix_cache_hits_created 1.7e9\n", WorkerFigures()),
        ("vllm:prefix_cache_queries_total 7 1764000000000\n", WorkerFigures(cache_queries=7)),
        (
            'vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="a}b"} 4\n',
            WorkerFigures(itl={INF: 4}),
        ),
    ],
    ids=["other samples only: zeros", "a sample with a timestamp", "le anywhere, a brace in a label"],
)
def test_worker_metric_lines(text: str, expected: WorkerFigures) -> None:
    assert parse_worker_metrics(text) == expected


def test_a_workers_tier_figures_are_read_per_medium_and_outcome() -> None:
    engine = EngineMetrics()
    engine.device_usage.labels("tiny").set(0.75)
    engine.tier_usage.labels("tiny", "host").set(0.5)
    engine.stored.labels("tiny", "host").inc(30)
    engine.restored.labels("tiny", "host").inc(12)
    engine.evicted.labels("tiny", "device").inc(30)
    engine.pulls.labels("tiny", "pulled").inc(2)
    engine.pulls.labels("tiny", "failed").inc()
    figures = parse_worker_metrics(engine.text())
    assert figures.tier_usage == {"device": 0.75, "host": 0.5}
    assert figures.tier_counters == {
        "stored:host": 30,
        "restored:host": 12,
        "evicted:device": 30,
        "pulls:pulled": 2,
        "pulls:failed": 1,
    }


def test_a_point_has_each_tiers_mean_usage_and_rates_and_the_pulls() -> None:
    old = Snapshot(
        at=0.0,
        wall=1000.0,
        cache_queries={("m", "w0"): 0},  # w0 was sampled: a tier series it shows later starts at zero
        tier_counters={("m", "w0", "restored:host"): 10, ("m", "w0", "pulls:pulled"): 1},
        tier_usage={("m", "w0", "host"): 0.2},
    )
    new = Snapshot(
        at=10.0,
        wall=1010.0,
        tier_counters={
            ("m", "w0", "restored:host"): 50,
            ("m", "w1", "restored:host"): 90,  # a worker new in this window: left out
            ("m", "w0", "stored:host"): 20,  # w0's first offloads
            ("m", "w0", "evicted:device"): 0,
            ("m", "w0", "pulls:pulled"): 6,
        },
        tier_usage={("m", "w0", "host"): 0.4, ("m", "w1", "host"): 0.8, ("m", "w0", "device"): 1.0},
    )
    model = point_between(old, new).models["m"]
    assert model.tiers == {
        "device": TierPoint(usage=1.0, stored_per_s=0.0, restored_per_s=0.0, evicted_per_s=0.0),
        "host": TierPoint(usage=0.6, stored_per_s=2.0, restored_per_s=4.0, evicted_per_s=0.0),
    }
    assert model.pulls_per_s == {"pulled": 0.5}


def test_a_malformed_value_is_an_error() -> None:
    with pytest.raises(ValueError, match="could not convert"):
        parse_worker_metrics('vllm:prefix_cache_hits_total{model_name="m"} many\n')


NAN_AND_NO_VALUE = {
    "nan-gauge": ('vllm:kv_cache_usage_perc{model_name="m"} NaN\n', WorkerFigures(num_skipped=1)),
    "inf-counter": (
        "vllm:prefix_cache_queries_total +Inf\nvllm:prefix_cache_hits_total 3\n",
        WorkerFigures(cache_hits=3, num_skipped=1),
    ),
    "minus-inf-tier-usage": (
        'herd_kv_tier_usage_perc{medium="host"} -Inf\nherd_kv_tier_usage_perc{medium="disk"} 0.5\n',
        WorkerFigures(tier_usage={"disk": 0.5}, num_skipped=1),
    ),
    "nan-bucket-count": (
        'vllm:inter_token_latency_seconds_bucket{le="0.1"} NaN\n'
        'vllm:inter_token_latency_seconds_bucket{le="+Inf"} 2\n',
        WorkerFigures(itl={INF: 2}, num_skipped=1),
    ),
    "nan-bucket-bound": (
        'vllm:inter_token_latency_seconds_bucket{le="NaN"} 1\n',
        WorkerFigures(num_skipped=1),
    ),
    "no-value": ("vllm:prefix_cache_hits_total\n", WorkerFigures(num_skipped=1)),
    "labels-but-no-value": (
        'vllm:prefix_cache_hits_total{model_name="m"}   \nvllm:prefix_cache_queries_total 4\n',
        WorkerFigures(cache_queries=4, num_skipped=1),
    ),
}


@pytest.mark.parametrize(("text", "expected"), NAN_AND_NO_VALUE.values(), ids=NAN_AND_NO_VALUE.keys())
def test_a_sample_without_a_finite_value_is_left_out(text: str, expected: WorkerFigures) -> None:
    assert parse_worker_metrics(text) == expected


def endpoint(worker_id: str, role: str = "unified") -> WorkerEndpoint:
    return WorkerEndpoint(worker_id, MODEL, f"http://{worker_id}.test", f"http://{worker_id}.internal", role)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("counted", "endpoints", "expected"),
    [
        ({}, [endpoint("w0"), endpoint("w1")], {(MODEL, "w0"): 0.0, (MODEL, "w1"): 0.0}),
        ({(MODEL, "w0"): 4.0}, [endpoint("w0"), endpoint("w1")], {(MODEL, "w0"): 4.0, (MODEL, "w1"): 0.0}),
        ({(MODEL, "gone"): 2.0}, [], {(MODEL, "gone"): 2.0}),
        ({(MODEL, "d0"): 3.0}, [endpoint("p0", "prefill"), endpoint("d0", "decode")], {(MODEL, "d0"): 3.0}),
    ],
    ids=[
        "known workers without requests count zero",
        "counted requests over the zeros",
        "a worker that left keeps its counter",
        "prefill workers answer no request of their own",
    ],
)
def test_requests_by_worker(
    counted: dict[tuple[str, ...], float],
    endpoints: list[WorkerEndpoint],
    expected: dict[tuple[str, str], float],
) -> None:
    assert requests_by_worker(counted, endpoints) == expected


HISTORY = HistorySettings(interval_seconds=0.02, window_seconds=5.0, span_seconds=60.0)
"""A window longer than the test: its four requests fall in one whatever the machine's load."""
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}


async def points(client: httpx.AsyncClient, since: float | None = None) -> list[dict[str, Any]]:
    params = {} if since is None else {"since": since}
    data = (await client.get("/dashboard/data", params=params)).json()
    found: list[dict[str, Any]] = data["history"]["points"]
    return found


async def test_the_app_samples_its_workers_and_serves_the_series() -> None:
    engines = {worker_id: EngineMetrics() for worker_id in ("w0", "w1")}
    workers = [FakeWorker(worker_id, metrics=engine.text()) for worker_id, engine in engines.items()]
    settings = AppSettings(registry=FAST_REGISTRY, history=HISTORY)
    async with running_gateway(FakeCluster(workers), settings=settings) as (_, client):
        first = await _wait_for_point(client, lambda model: model["request_rate"] == 0.0)
        for _ in range(4):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        # Once a point counts the requests, the healthy workers have been scraped before their work.
        busy = await _wait_for_point(client, lambda model: model["shares"] == {"w0": 0.5, "w1": 0.5})
        for worker, engine in zip(workers, engines.values(), strict=True):
            engine.queries.labels("tiny").inc(100)
            engine.hits.labels("tiny").inc(75)
            engine.itl.labels("tiny").observe(0.05)
            worker.metrics = engine.text()
        cached = await _wait_for_point(client, lambda model: model["hit_rate"] is not None)
        newer = await points(client, since=first["wall"])
    assert busy["models"]["tiny"]["request_rate"] > 0
    assert (cached["models"]["tiny"]["hit_rate"], cached["models"]["tiny"]["itl_p50_ms"]) == (0.75, 55.0)
    assert cached in newer and all(point["wall"] > first["wall"] for point in newer)


async def _wait_for_point(
    client: httpx.AsyncClient, check: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """The newest point whose model ``tiny`` passes ``check``, polling for at most 10 s."""
    for _ in range(500):
        for point in reversed(await points(client)):
            if "tiny" in point["models"] and check(point["models"]["tiny"]):
                return point
        await asyncio.sleep(0.02)
    raise AssertionError("no history point matched within 10 s")


async def test_the_sampling_task_stops_with_the_app() -> None:
    settings = AppSettings(registry=FAST_REGISTRY, history=HISTORY)
    async with running_gateway(FakeCluster([FakeWorker("w0")]), settings=settings):
        assert [task for task in asyncio.all_tasks() if task.get_name() == "herd-history"]
    assert not [task for task in asyncio.all_tasks() if task.get_name() == "herd-history"]


async def test_a_workers_bad_samples_are_left_out_of_the_points_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = EngineMetrics()
    engine.device_usage.labels("tiny").set(math.nan)
    engine.tier_usage.labels("tiny", "host").set(0.5)
    page = engine.text() + 'vllm:prefix_cache_hits_total{model_name="tiny"}\n'  # no value: skipped too
    settings = AppSettings(registry=FAST_REGISTRY, history=HISTORY)
    async with running_gateway(FakeCluster([FakeWorker("w0", metrics=page)]), settings=settings) as (
        _,
        client,
    ):
        await _wait_for_point(client, lambda model: "host" in model["tiers"])
        for _ in range(3):  # more samples: still one warning
            await _wait_for_point(client, lambda model: True)
            await asyncio.sleep(HISTORY.interval_seconds)
        response = await client.get("/dashboard/data")
    assert response.status_code == 200
    tiers = response.json()["history"]["points"][-1]["models"]["tiny"]["tiers"]
    assert set(tiers) == {"host"} and tiers["host"]["usage"] == 0.5
    warnings = [record for record in caplog.records if "NaN or infinite" in record.getMessage()]
    assert len(warnings) == 1 and warnings[0].__dict__["worker"] == "w0"
