"""Load generator statistics: percentiles, latency pooling, throughput, cache hits, shares, errors."""

from __future__ import annotations

import numpy as np
import pytest

from herd.cli.loadgen.client import RequestResult
from herd.cli.loadgen.stats import build_report, percentile, summarize


@pytest.mark.parametrize(
    ("values", "q"),
    [
        ([5.0], 50),
        ([1.0, 2.0], 50),
        ([3.0, 1.0, 2.0, 10.0], 90),
        (list(range(101)), 99),
        ([0.2, 0.1, 0.4], 0),
    ],
    ids=["single", "two-midpoint", "unsorted-p90", "hundred-p99", "p0-is-min"],
)
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summarize_reports_milliseconds_and_nothing_for_no_samples() -> None:
    assert summarize([]) is None
    assert summarize([0.001, 0.002, 0.003, 0.010]) == {
        "mean": 4.0,
        "p50": 2.5,
        "p90": pytest.approx(7.9),
        "p99": pytest.approx(9.79),
    }


def _result(
    chunk_times: list[float], e2e: float, *, prompt: int = 100, cached: int | None = 25, worker: str = "a"
) -> RequestResult:
    return RequestResult(
        start=0.0,
        e2e=e2e,
        chunk_times=chunk_times,
        prompt_tokens=prompt,
        output_tokens=len(chunk_times),
        cached_tokens=cached,
        worker=worker,
    )


@pytest.fixture
def report() -> dict[str, object]:
    results = [
        _result([0.1, 0.2, 0.4], 0.5, prompt=100, cached=50, worker="a"),
        _result([0.3, 0.4], 0.6, prompt=300, cached=0, worker="b"),
        _result([0.2, 0.25, 0.3, 0.35], 0.4, prompt=100, cached=None, worker="a"),
        RequestResult(start=0.0, e2e=0.05, error="HTTP 503: no worker available"),
        RequestResult(start=0.0, e2e=0.05, error="HTTP 503: no worker available"),
    ]
    return build_report(results, elapsed_s=2.0)


def test_counts_errors_and_throughput(report: dict[str, object]) -> None:
    assert (report["num_requests"], report["num_completed"], report["num_errors"]) == (5, 3, 2)
    assert report["errors"] == {"HTTP 503: no worker available": 2}
    assert report["request_throughput"] == 1.5
    assert report["total_output_tokens"] == 9
    assert report["output_token_throughput"] == 4.5
    assert report["input_token_throughput"] == 250.0


def test_latencies_pool_as_documented(report: dict[str, object]) -> None:
    assert report["ttft_ms"] == summarize([0.1, 0.3, 0.2])
    assert report["itl_ms"] == summarize([0.1, 0.2, 0.1, 0.05, 0.05, 0.05])
    assert report["tpot_ms"] == summarize([(0.5 - 0.1) / 2, (0.6 - 0.3) / 1, (0.4 - 0.2) / 3])
    assert report["e2e_ms"] == summarize([0.5, 0.6, 0.4])


def test_cache_hit_rate_uses_only_requests_that_reported_usage(report: dict[str, object]) -> None:
    assert report["prefix_cache_hit_rate"] == 0.125


def test_worker_share_counts_successful_requests(report: dict[str, object]) -> None:
    assert report["worker_share"] == {"a": 0.6667, "b": 0.3333}


def test_a_run_without_usage_has_no_hit_rate_and_counts_chunks() -> None:
    result = RequestResult(start=0.0, e2e=1.0, chunk_times=[0.5, 0.6, 0.7])
    report = build_report([result], elapsed_s=1.0)
    assert report["prefix_cache_hit_rate"] is None
    assert report["total_output_tokens"] == 3
    assert report["worker_share"] == {}
