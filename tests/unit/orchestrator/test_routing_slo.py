"""SLO-aware routing: the online latency fit, the headroom choice inside ``decide``, the headers."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway

from herd.api.crd import LeastRequestRouting
from herd.api.errors import HttpError
from herd.orchestrator.admission.targets import slo_target
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.routing import RequestContext, UnroutableError, WorkerView, decide
from herd.orchestrator.routing._types import SloTarget
from herd.orchestrator.routing.latency import (
    LatencyFeatures,
    LatencyModel,
    OnlineRegression,
    Prediction,
    ttft_prior,
)
from herd.orchestrator.routing.slo import headroom
from herd.orchestrator.served import ServedModel

BLOCK = 16


def test_the_fit_recovers_a_linear_latency() -> None:
    rng = random.Random(7)
    fit = OnlineRegression(4, decay=1.0)
    for _ in range(200):
        features = LatencyFeatures(rng.randrange(0, 8000), rng.randrange(0, 32), rng.randrange(0, 4000))
        ttft = 0.02 + 0.05 * features.queued_prefill_tokens / 1000 + 0.001 * features.batch
        fit.observe(features.ttft_row(), ttft + 0.04 * features.uncached_prompt_tokens / 1000)
    probe = LatencyFeatures(4000, 10, 2000)
    assert fit.predict(probe.ttft_row()) == pytest.approx(0.02 + 0.2 + 0.01 + 0.08, rel=1e-3)


def test_decay_follows_a_worker_that_slowed_down() -> None:
    fit = OnlineRegression(3, decay=0.9)
    row = LatencyFeatures(0, 4, 0).tpot_row()
    for value in [0.01] * 50 + [0.05] * 50:
        fit.observe(row, value)
    assert fit.predict(row) == pytest.approx(0.05, rel=0.01)


def test_a_worker_without_samples_borrows_the_pooled_fit() -> None:
    latency = LatencyModel(min_samples=4)
    features = LatencyFeatures(1000, 2, 100)
    assert latency.predict("a", features) is None
    for _ in range(4):
        latency.observe_ttft("a", features, 0.5)
        latency.observe_tpot("a", features, 0.02)
    borrowed = latency.predict("b", features)
    assert borrowed is not None and borrowed.ttft_seconds == pytest.approx(0.5, rel=1e-3)
    for _ in range(4):
        latency.observe_ttft("b", features, 0.1)
        latency.observe_tpot("b", features, 0.02)
    own = latency.predict("b", features)
    assert own is not None and own.ttft_seconds == pytest.approx(0.1, rel=1e-3)


@pytest.mark.parametrize(
    ("rate", "expected"),
    [(None, {}), (0.0, {}), (500.0, {1: 2.0, 3: 2.0}), (2000.0, {1: 0.5, 3: 0.5})],
    ids=["unmeasured", "zero", "500-per-s", "2000-per-s"],
)
def test_the_prior_slopes_are_the_seconds_a_thousand_tokens_take(
    rate: float | None, expected: dict[int, float]
) -> None:
    assert ttft_prior(rate) == expected


def idle_samples(latency: LatencyModel, worker_id: str, num: int = 16) -> None:
    """Samples of a worker that never had prefill queued: TTFT 0.2 s plus 50 ms a request in its batch."""
    for n in range(num):
        features = LatencyFeatures(0, n % 4, 64)
        latency.observe_ttft(worker_id, features, 0.2 + 0.05 * features.batch)
        latency.observe_tpot(worker_id, features, 0.02)


@pytest.mark.parametrize(
    ("rate", "queued", "expected"),
    [
        (None, 0, 0.2),
        (None, 3000, 0.2),  # no sample ever had prefill queued: the fit alone says it costs nothing
        (500.0, 0, 0.2),
        (500.0, 3000, 0.2 + 6.0),  # 2 s per 1,000 tokens: no sample says otherwise
        (1000.0, 3000, 0.2 + 3.0),
    ],
    ids=["no-rate-idle", "no-rate-queued", "rate-idle", "rate-queued", "faster-rate-queued"],
)
def test_the_prefill_rate_prices_queued_prefill_before_any_sample_had_it(
    rate: float | None, queued: int, expected: float
) -> None:
    latency = LatencyModel()
    idle_samples(latency, "w")
    prediction = latency.predict("w", LatencyFeatures(queued, 0, 64), rate)
    assert prediction is not None and prediction.ttft_seconds == pytest.approx(expected, abs=0.01)


def test_samples_enough_outweigh_the_prior() -> None:
    """A worker whose queued prefill truly costs 0.1 s per 1,000 tokens, against a prior of 2 s."""
    latency = LatencyModel()
    for n in range(300):
        features = LatencyFeatures(500 * (n % 9), n % 4, 64 + 1000 * (n % 2))
        ttft = (
            0.2 + 0.1 * features.queued_prefill_tokens / 1000 + 0.1 * features.uncached_prompt_tokens / 1000
        )
        latency.observe_ttft("w", features, ttft)
        latency.observe_tpot("w", features, 0.02)
    prediction = latency.predict("w", LatencyFeatures(4000, 0, 64), 500.0)
    truth, prior_alone = 0.2 + 0.4 + 0.0064, 0.2 + 8.0 + 0.128
    assert prediction is not None
    assert abs(prediction.ttft_seconds - truth) < 0.1 * (prior_alone - truth)


@pytest.mark.parametrize(("rate", "worker"), [(None, "queued"), (500.0, "idle")], ids=["no-rate", "rate"])
def test_decide_avoids_a_worker_with_prefill_queued_that_its_samples_never_priced(
    rate: float | None, worker: str
) -> None:
    """Both fits learnt only idle samples; the busy worker has 1,500 prompt tokens in flight and a
    batch of 1, the idle one a batch of 4 (predicted 0.25 s against 0.4 s without the prior)."""
    model = served(warm=False)
    idle_samples(model.latency, "queued")
    idle_samples(model.latency, "idle")
    views = [
        WorkerView(id="queued", url="http://q", num_running=1, prefill_tokens_per_s=rate),
        WorkerView(id="idle", url="http://i", num_running=4, prefill_tokens_per_s=rate),
    ]
    views[0] = replace(views[0], num_prefill_tokens_in_flight=1500)
    decision = decide(model, views, ctx(ttft_seconds=2.0))
    assert decision.worker.id == worker and not decision.is_slo_missed


@pytest.mark.parametrize(
    ("ttft", "tpot", "target", "expected"),
    [
        (0.5, 0.05, SloTarget(1.0, None), 0.5),
        (0.5, 0.05, SloTarget(None, 0.1), 0.5),
        (0.5, 0.05, SloTarget(1.0, 0.06), pytest.approx(1 / 6)),
        (1.5, 0.05, SloTarget(1.0, 0.1), -0.5),
    ],
    ids=["ttft-only", "tpot-only", "tighter-of-two", "missed"],
)
def test_headroom_is_the_smallest_relative_slack(
    ttft: float, tpot: float, target: SloTarget, expected: float
) -> None:
    assert headroom(Prediction(ttft, tpot), target) == expected


def served(*, warm: bool = True) -> ServedModel:
    """A model whose every worker's TTFT is 0.1 s per 1,000 queued prefill tokens; TPOT 10 ms a request."""
    model = ServedModel(ModelConfig("m", LeastRequestRouting(strategy="least_request"), block_size=BLOCK))
    if warm:
        for queued in range(0, 10_000, 500):
            for batch in range(10):
                features = LatencyFeatures(queued, batch, 0)
                model.latency.observe_ttft("any", features, 0.1 * queued / 1000)
                model.latency.observe_tpot("any", features, 0.01 * batch)
    return model


def view(worker_id: str, queued: int = 0, batch: int = 0) -> WorkerView:
    return WorkerView(
        id=worker_id, url=f"http://{worker_id}", num_waiting_prefill_tokens=queued, num_running=batch
    )


def ctx(**target: Any) -> RequestContext:
    return RequestContext(model="m", slo=SloTarget(**target))


@pytest.mark.parametrize(
    ("views", "target", "worker", "missed"),
    [
        ([view("a", 3000), view("b", 1000), view("c", 6000)], {"ttft_seconds": 0.5}, "b", False),
        (
            [view("a", 0, batch=8), view("b", 2000, batch=1)],
            {"ttft_seconds": 0.5, "tpot_seconds": 0.05},
            "b",
            False,
        ),
        ([view("a", 9000), view("b", 8000)], {"ttft_seconds": 0.5}, "b", True),
        ([view("a", 9000), view("b", 8000)], {"ttft_seconds": 0.5, "on_miss": "lower"}, "b", True),
    ],
    ids=["most-headroom", "both-targets", "missed-routes-closest", "missed-lowers"],
)
def test_decide_picks_by_predicted_latency(
    views: list[WorkerView], target: dict[str, Any], worker: str, missed: bool
) -> None:
    decision = decide(served(), views, ctx(**target))
    assert (decision.worker.id, decision.is_slo_missed) == (worker, missed)
    assert decision.features is not None and decision.predicted is not None


@pytest.mark.parametrize(("policy", "reason"), [("queue", "at_capacity"), ("refuse", "slo_unmet")])
def test_a_missed_target_waits_or_is_refused(policy: str, reason: str) -> None:
    with pytest.raises(UnroutableError) as raised:
        decide(served(), [view("a", 9000)], ctx(ttft_seconds=0.5, on_miss=policy))
    assert raised.value.reason == reason


def test_before_any_sample_the_strategy_decides() -> None:
    views = [view("a", 9000), view("b", 0)]
    views[1] = replace(views[1], num_in_flight=3)
    decision = decide(served(warm=False), views, ctx(ttft_seconds=0.01, on_miss="refuse"))
    assert decision.worker.id == "a" and not decision.is_slo_missed  # least in flight
    assert decision.predicted is None


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"x-slo-ttft-ms": "250"}, SloTarget(0.25, None, "route")),
        ({"x-slo-tpot-ms": "20", "x-slo-policy": "Queue"}, SloTarget(None, 0.02, "queue")),
        (
            {"x-slo-ttft-ms": "1000", "x-slo-tpot-ms": "50", "x-slo-policy": "refuse"},
            SloTarget(1.0, 0.05, "refuse"),
        ),
    ],
    ids=["none", "ttft", "tpot-queue", "both-refuse"],
)
def test_targets_from_headers(headers: dict[str, str], expected: SloTarget | None) -> None:
    assert slo_target(headers, "route") == expected


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ({"x-slo-ttft-ms": "fast"}, "x-slo-ttft-ms"),
        ({"x-slo-tpot-ms": "-3"}, "x-slo-tpot-ms"),
        ({"x-slo-ttft-ms": "nan"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "100", "x-slo-policy": "drop"}, "x-slo-policy"),
    ],
    ids=["word", "negative", "nan", "unknown-policy"],
)
def test_bad_targets_are_400_naming_the_header(headers: dict[str, str], named: str) -> None:
    with pytest.raises(HttpError) as raised:
        slo_target(headers, "route")
    assert raised.value.status == 400 and named in raised.value.message


def warm_gateway_model(app: Any) -> None:
    latency = app.state.registry.models[MODEL].latency
    for queued in (0, 1000, 2000):
        for batch in range(5):
            features = LatencyFeatures(queued, batch, 0)
            latency.observe_ttft("w0", features, 1.0 + queued / 1000)
            latency.observe_tpot("w0", features, 0.01)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("policy", "status", "priority"),
    [("refuse", 429, None), ("lower", 200, 1000), ("route", 200, None)],
)
async def test_the_gateway_applies_the_miss_policy(policy: str, status: int, priority: int | None) -> None:
    cluster = FakeCluster([FakeWorker("w0")])
    headers = {"x-slo-ttft-ms": "200", "x-slo-policy": policy}
    async with running_gateway(cluster) as (app, client):
        warm_gateway_model(app)
        response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status_code == status
    if status == 429:
        assert "latency targets" in response.json()["error"]["message"] and "retry-after" in response.headers
    else:
        assert cluster.workers[0].bodies[0].get("priority") == priority


async def test_streams_feed_the_latency_model() -> None:
    cluster = FakeCluster([FakeWorker("w0", num_chunks=5, chunk_delay=0.01)])
    async with running_gateway(cluster) as (app, client):
        for _ in range(3):
            await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        latency: LatencyModel = app.state.registry.models[MODEL].latency
    assert latency.num_samples("w0") == (3, 3)


async def test_the_access_log_line_of_an_slo_stream_has_the_prediction_and_what_followed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster = FakeCluster([FakeWorker("w0", num_chunks=3, chunk_delay=0.01)])
    async with running_gateway(cluster) as (app, client):
        warm_gateway_model(app)
        with caplog.at_level("INFO", logger="herd.access"):
            await client.post(
                "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-slo-ttft-ms": "5000"}
            )
            await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    notes = [getattr(record, "slo", None) for record in caplog.records if record.name == "herd.access"]
    assert len(notes) == 2 and notes[1] is None
    assert notes[0] is not None and notes[0]["predicted_ttft_ms"] == pytest.approx(1000, abs=50)
    assert 0 < notes[0]["observed_ttft_ms"] < 5000 and notes[0]["batch"] == 0
