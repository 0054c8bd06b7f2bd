"""Per-tenant requests and tokens per minute: the window arithmetic, the counters, through the gateway."""

from __future__ import annotations

import pytest
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway

from herd.api.errors import HttpError
from herd.orchestrator.admission.quotas import Quotas, QuotaUse, QuotaWindow
from herd.orchestrator.admission.tenants import Quotas as Limits
from herd.orchestrator.admission.tenants import Tenant
from herd.orchestrator.admission.usage import StreamTally, Usage
from herd.orchestrator.auth import ApiKeys
from herd.orchestrator.state import MemoryState, RedisState

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def tenant(rpm: int | None = None, tpm: int | None = None) -> Tenant:
    return Tenant(name="t", quotas=Limits(requests_per_minute=rpm, tokens_per_minute=tpm))


@pytest.mark.parametrize(
    ("limits", "requests", "tokens", "exceeded"),
    [
        ((None, None), 10**6, 10**9, None),
        ((5, None), 5, 0, None),
        ((5, None), 6, 0, "requests"),
        ((None, 100), 1, 99, None),
        ((None, 100), 1, 100, "tokens"),
        ((5, 100), 6, 100, "requests"),
    ],
    ids=["no-limits", "last-request", "one-request-over", "tokens-left", "tokens-spent", "requests-first"],
)
def test_which_limit_a_request_meets(
    limits: tuple[int | None, int | None], requests: int, tokens: int, exceeded: str | None
) -> None:
    use = QuotaUse(tenant(*limits), requests, tokens, reset_seconds=10.0)
    assert use.exceeded() == exceeded


def test_headers_follow_openai() -> None:
    headers = QuotaUse(tenant(rpm=10, tpm=1000), 3, 1200, reset_seconds=12.2).headers()
    assert headers == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "7",
        "x-ratelimit-reset-requests": "13s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "13s",
    }
    assert QuotaUse(tenant(rpm=10), 1, 0, 1.0).headers().keys() == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }


@pytest.mark.parametrize(
    ("now", "index", "reset"), [(0.0, 0, 60.0), (59.5, 0, 0.5), (60.0, 1, 60.0), (125.0, 2, 55.0)]
)
def test_windows_are_wall_clock_minutes(now: float, index: int, reset: float) -> None:
    window = QuotaWindow(now)
    assert (window.index, window.reset_seconds) == (index, reset)
    assert window.key(tenant(), "tokens") == f"herd:quota:t:tokens:{index}"


async def test_a_minute_admits_its_requests_then_refuses_until_the_next() -> None:
    quotas = Quotas(MemoryState())
    for _ in range(3):
        assert await quotas.admit(tenant(rpm=3), now=30.0) is not None
    with pytest.raises(HttpError) as raised:
        await quotas.admit(tenant(rpm=3), now=45.0)
    assert raised.value.status == 429 and raised.value.headers["Retry-After"] == "15"
    assert raised.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert await quotas.admit(tenant(rpm=3), now=61.0) is not None


async def test_spent_tokens_close_the_minute() -> None:
    quotas = Quotas(MemoryState())
    await quotas.admit(tenant(tpm=100), now=1.0)
    await quotas.spend(tenant(tpm=100), 100, now=2.0)
    with pytest.raises(HttpError, match="100 tokens per minute"):
        await quotas.admit(tenant(tpm=100), now=3.0)


async def test_replicas_share_the_counts_through_redis(redis_url: str) -> None:
    states = [RedisState(redis_url, timeout_seconds=5.0) for _ in range(2)]  # a loaded runner's Redis
    name = Tenant(name="shared-across-replicas", quotas=Limits(requests_per_minute=4))
    try:
        admitted = 0
        for number in range(6):
            try:
                await Quotas(states[number % 2]).admit(name, now=600.0)
                admitted += 1
            except HttpError:
                pass
        assert admitted == 4
        assert not any(state.is_degraded for state in states)
    finally:
        for state in states:
            await state.close()


async def test_the_gateway_answers_429_with_ratelimit_headers() -> None:
    keys = ApiKeys.of_tenants(
        [("k", Tenant(name="small", quotas=Limits(requests_per_minute=2, tokens_per_minute=16)))]
    )
    cluster = FakeCluster([FakeWorker("w0")])
    headers = {"authorization": "Bearer k"}
    async with running_gateway(cluster, api_keys=keys) as (_, client):
        first = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        second = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        third = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429)
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-tokens"] == "8"  # the fake's usage: 8 tokens an answer
    assert third.headers["x-ratelimit-remaining-requests"] == "0" and "retry-after" in third.headers
    assert third.json()["error"]["type"] == "rate_limit_error"
    assert cluster.workers[0].num_requests == 2


async def test_tokens_per_minute_count_the_answers_usage() -> None:
    keys = ApiKeys.of_tenants([("k", Tenant(name="tpm", quotas=Limits(tokens_per_minute=16)))])
    cluster = FakeCluster([FakeWorker("w0")])
    headers = {"authorization": "Bearer k"}
    async with running_gateway(cluster, api_keys=keys) as (_, client):
        statuses = [
            (await client.post("/v1/chat/completions", json=CHAT, headers=headers)).status_code
            for _ in range(3)
        ]
    assert statuses == [200, 200, 429]


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([b'data: {"role"}\n\n', b'data: {"a"}\n\ndata: {"b"}\n\n', b"data: [DONE]\n\n"], Usage(7, 2)),
        (
            [
                b'data: {"x"}\n\n',
                b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9}}\n\n',
            ],
            Usage(3, 9),
        ),
        ([b"data: [DONE]\n\n"], Usage(7, 0)),
    ],
    ids=["counted-events", "usage-event", "empty"],
)
def test_a_streams_usage(chunks: list[bytes], expected: Usage) -> None:
    tally = StreamTally()
    for chunk in chunks:
        tally.observe(chunk)
    assert tally.total(num_prompt_tokens=7) == expected
