"""Worker metrics for the autoscaler: p95 from histogram bucket deltas, parsing, pooling over pods."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from herd.api import metrics as names
from herd.operator.metrics_source import (
    Buckets,
    Scrape,
    bucket_deltas,
    metrics_url,
    observe,
    parse_scrape,
    quantile,
)

INF = math.inf

QUANTILES = [
    ("empty", [], None),
    ("no-observations", [((0.1, 0.0), (1.0, 0.0), (INF, 0.0))], None),
    ("all-in-first-bucket", [((0.1, 100.0), (1.0, 100.0), (INF, 100.0))], 0.095),
    ("interpolated-in-second", [((0.1, 50.0), (1.0, 100.0), (INF, 100.0))], 0.91),
    ("above-last-finite-bound", [((0.1, 0.0), (1.0, 10.0), (INF, 100.0))], 1.0),
    (
        "summed-over-pods",
        [((0.1, 90.0), (1.0, 90.0), (INF, 90.0)), ((0.1, 0.0), (1.0, 10.0), (INF, 10.0))],
        0.55,
    ),
]


@pytest.mark.parametrize(
    ("histograms", "expected"), [c[1:] for c in QUANTILES], ids=[c[0] for c in QUANTILES]
)
def test_p95_from_buckets(histograms: list[Buckets], expected: float | None) -> None:
    found = quantile(0.95, histograms)
    assert found == (None if expected is None else pytest.approx(expected))


DELTAS = [
    ("growth", ((0.1, 1.0), (INF, 2.0)), ((0.1, 4.0), (INF, 7.0)), ((0.1, 3.0), (INF, 5.0))),
    ("pod-restarted", ((0.1, 9.0), (INF, 9.0)), ((0.1, 1.0), (INF, 2.0)), ((0.1, 1.0), (INF, 2.0))),
    ("first-samples", (), ((0.1, 1.0), (INF, 1.0)), ((0.1, 1.0), (INF, 1.0))),
]


@pytest.mark.parametrize(("before", "after", "expected"), [c[1:] for c in DELTAS], ids=[c[0] for c in DELTAS])
def test_bucket_deltas(before: Buckets, after: Buckets, expected: Buckets) -> None:
    assert bucket_deltas(before, after) == expected


def worker_text(ttft_s: list[float], *, waiting: float = 0.0, kv: float = 0.5, itl: bool = True) -> str:
    """A /metrics body as the worker renders it (prometheus_client, vLLM names, a model label)."""
    registry = CollectorRegistry()
    ttft = Histogram(
        names.TIME_TO_FIRST_TOKEN_SECONDS, "ttft", ["model_name"], buckets=(0.1, 1.0), registry=registry
    )
    if itl:
        Histogram(names.INTER_TOKEN_LATENCY_SECONDS, "itl", ["model_name"], registry=registry)
    Gauge(names.NUM_REQUESTS_WAITING, "waiting", registry=registry).set(waiting)
    Gauge(names.KV_CACHE_USAGE_PERC, "kv", registry=registry).set(kv)
    for value in ttft_s:
        ttft.labels("m").observe(value)
    return generate_latest(registry).decode()


def test_parse_a_worker_body() -> None:
    scrape = parse_scrape(worker_text([0.05, 0.5, 5.0], waiting=2.0, kv=0.25))
    assert scrape.histograms[names.TIME_TO_FIRST_TOKEN_SECONDS] == ((0.1, 1.0), (1.0, 2.0), (INF, 3.0))
    assert scrape.histograms[names.INTER_TOKEN_LATENCY_SECONDS] == ()  # no samples yet: empty, present
    assert scrape.gauges == {names.NUM_REQUESTS_WAITING: 2.0, names.KV_CACHE_USAGE_PERC: 0.25}
    assert scrape.is_complete
    assert not parse_scrape(worker_text([], itl=False)).is_complete


def test_observe_uses_deltas_between_scrapes_of_each_pod() -> None:
    before = {"a": parse_scrape(worker_text([0.05] * 10)), "b": parse_scrape(worker_text([]))}
    after = {
        "a": parse_scrape(worker_text([0.05] * 10 + [0.5] * 10, waiting=1.0, kv=0.2)),
        "b": parse_scrape(worker_text([0.5] * 10, kv=0.4)),
    }
    observed = observe(before, after)
    # 20 new observations, all in (0.1, 1.0]: p95 at rank 19 interpolates to 0.1 + 0.9 * 19/20.
    assert observed.ttft_p95_ms == pytest.approx(955.0)
    assert observed.itl_p95_ms is None
    assert (observed.num_waiting, observed.kv_usage) == (1.0, pytest.approx(0.3))
    assert observed.is_complete


@pytest.mark.parametrize(
    ("previous", "current"),
    [({}, {"a": "ok"}), ({"a": "ok"}, {"a": None}), ({"a": "ok"}, {"a": "no-itl"}), ({}, {})],
    ids=["no-previous-scrape", "pod-did-not-answer", "metric-missing", "no-ready-pod"],
)
def test_observe_is_incomplete(previous: dict[str, str], current: dict[str, str | None]) -> None:
    bodies: dict[str | None, Scrape | None] = {
        "ok": parse_scrape(worker_text([0.05])),
        "no-itl": parse_scrape(worker_text([0.05], itl=False)),
        None: None,
    }
    before = {pod: bodies[kind] for pod, kind in previous.items()}
    observed = observe(
        {pod: scrape for pod, scrape in before.items() if scrape}, {p: bodies[k] for p, k in current.items()}
    )
    assert not observed.is_complete


POD = {
    "status": {"podIP": "127.0.0.7"},
    "spec": {
        "containers": [
            {"ports": [{"name": "internal", "containerPort": 9000}, {"name": "http", "containerPort": 8000}]}
        ]
    },
}


def test_metrics_url_uses_the_port_named_http() -> None:
    assert metrics_url(POD) == "http://127.0.0.7:8000/metrics"
    assert metrics_url({**POD, "status": {}}) is None
