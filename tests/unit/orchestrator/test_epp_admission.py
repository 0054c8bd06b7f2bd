"""Admission in ``herd epp``, as far as ext_proc allows: tenants from the API key, their models and
quotas (immediate 401 / 403 / 429 with ``x-ratelimit-*``, tokens charged from the answer's usage),
SLO headers, and the fair queue a request waits in while Envoy holds it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from support.epp_fakes import RunningEpp, chat_body, destination_of, running_epp
from support.gateway_fakes import FAST_REGISTRY, FakeCluster, FakeWorker

from herd.orchestrator.admission.waiting import QueueSettings
from herd.orchestrator.auth import load_api_keys
from herd.orchestrator.epp.picker import PickerSettings
from herd.orchestrator.epp.server import EppSettings

KEYS = """
tenants:
  - {name: paying, keys: [k-paying], quotas: {requestsPerMinute: 2}}
  - {name: metered, keys: [k-metered], quotas: {tokensPerMinute: 40}}
  - {name: elsewhere, keys: [k-elsewhere], models: [other]}
"""


def settings(tmp_path: Path, *, max_wait: float = 5.0) -> EppSettings:
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS)
    picker = PickerSettings(queue=QueueSettings(max_wait_seconds=max_wait))
    return EppSettings(registry=FAST_REGISTRY, picker=picker, api_keys=load_api_keys(path))


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def refusal(epp: RunningEpp, **headers: str) -> tuple[int, dict[str, str], dict[str, object]]:
    stream = epp.stream()
    answers = await stream.request(chat_body(), extra=headers)
    await stream.close()
    assert answers[-1].HasField("immediate_response"), answers[-1]
    immediate = answers[-1].immediate_response
    sent = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return immediate.status.code, sent, json.loads(immediate.body)["error"]


@pytest.mark.parametrize(
    ("headers", "status", "words"),
    [
        ({}, 401, "API key"),
        (bearer("k-unknown"), 401, "API key"),
        (bearer("k-elsewhere"), 403, "may not use model"),
        ({**bearer("k-paying"), "x-slo-ttft-ms": "soon"}, 400, "x-slo-ttft-ms"),
    ],
    ids=["no-key", "unknown-key", "model-not-allowed", "bad-slo-header"],
)
async def test_a_request_its_tenant_may_not_send_is_answered_at_once(
    tmp_path: Path, headers: dict[str, str], status: int, words: str
) -> None:
    cluster = FakeCluster([FakeWorker("w0")])
    async with running_epp(cluster, settings=settings(tmp_path)) as epp:
        got, _, error = await refusal(epp, **headers)
        assert got == status and words in str(error["message"])
        assert cluster.workers[0].num_requests == 0 and epp.in_flight() == {"w0": 0}


async def test_a_tenants_requests_per_minute_are_counted_and_answered_as_openai_does(tmp_path: Path) -> None:
    async with running_epp(FakeCluster([FakeWorker("w0")]), settings=settings(tmp_path)) as epp:
        for remaining in ("1", "0"):
            stream = epp.stream()
            await stream.request(chat_body(), extra=bearer("k-paying"))
            answers = await stream.response(
                body_chunks=[b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4}}']
            )
            added = {
                h.header.key: h.header.raw_value.decode()
                for h in answers[0].response_headers.response.header_mutation.set_headers
            }
            assert added["x-ratelimit-limit-requests"] == "2"
            assert added["x-ratelimit-remaining-requests"] == remaining
            await stream.close()
        status, sent, error = await refusal(epp, **bearer("k-paying"))
        assert status == 429 and sent["x-ratelimit-remaining-requests"] == "0" and "Retry-After" in sent
        assert error["type"] == "rate_limit_error"


async def test_the_tokens_an_answer_used_count_against_its_tenants_quota(tmp_path: Path) -> None:
    async with running_epp(FakeCluster([FakeWorker("w0")]), settings=settings(tmp_path)) as epp:
        stream = epp.stream()
        await stream.request(chat_body(), extra=bearer("k-metered"))
        await stream.response(
            body_chunks=[b'{"id": "x", "usage": ', b'{"prompt_tokens": 30, "completion_tokens": 20}}']
        )
        await stream.close()
        for _ in range(100):  # the spend is written beside the answer's end
            status, sent, _ = await refusal(epp, **bearer("k-metered"))
            if status == 429:
                break
            await asyncio.sleep(0.02)
        assert status == 429 and sent["x-ratelimit-remaining-tokens"] == "0"


async def test_a_request_that_finds_every_worker_full_waits_in_line_while_envoy_holds_it(
    tmp_path: Path,
) -> None:
    cluster = FakeCluster([FakeWorker("w0")])
    async with running_epp(
        cluster, model_config={"max_in_flight_per_worker": 1}, settings=settings(tmp_path)
    ) as epp:
        first = epp.stream()
        await first.request(chat_body(), extra=bearer("k-paying"))
        second = epp.stream()
        waiting = asyncio.create_task(second.request(chat_body(), extra=bearer("k-metered")))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # held: no immediate 429
        await first.response()
        answers = await asyncio.wait_for(waiting, 5)
        assert destination_of(answers[-1])[0] == "w0.test"
        await first.close()
        await second.close()


async def test_a_wait_past_the_queues_limit_is_a_429(tmp_path: Path) -> None:
    cluster = FakeCluster([FakeWorker("w0")])
    async with running_epp(
        cluster, model_config={"max_in_flight_per_worker": 1}, settings=settings(tmp_path, max_wait=0.2)
    ) as epp:
        held = epp.stream()
        await held.request(chat_body(), extra=bearer("k-paying"))
        status, sent, error = await refusal(epp, **bearer("k-metered"))
        assert (status, sent["Retry-After"]) == (429, "1") and "waited in the queue" in str(error["message"])
        await held.close()
