"""Admission in ``herd epp``, as far as ext_proc allows: tenants from the API key, their models and
quotas (immediate 401 / 403 / 429 with ``x-ratelimit-*``, tokens charged from the answer's usage),
SLO headers, the slot reserve that batch-priority requests leave to urgent ones, and the bounded fair
queue a request waits in while Envoy holds it (a full queue sheds the least urgent with a 429)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from support.epp_fakes import RunningEpp, chat_body, destination_of, running_epp
from support.gateway_fakes import FAST_REGISTRY, MODEL, FakeCluster, FakeWorker, wait_for

from herd.api.crd import LeastRequestRouting
from herd.orchestrator.admission.waiting import QueueSettings
from herd.orchestrator.auth import load_api_keys
from herd.orchestrator.epp.picker import PickerSettings
from herd.orchestrator.epp.server import EppSettings
from herd.orchestrator.routing.headroom import IdleHeadroom
from herd.orchestrator.routing.reserve import SlotReserve

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


BATCH = 1000
"""The lowest priority, a batch line's: such requests are background to the slot reserve."""


def anonymous(
    *, max_size: int = 1024, share: float = 0.25, headroom: IdleHeadroom | None = None
) -> EppSettings:
    queue = QueueSettings(max_size=max_size, max_wait_seconds=5.0)
    picker = PickerSettings(
        queue=queue, slot_reserve=SlotReserve(share=share), idle_headroom=headroom or IdleHeadroom()
    )
    return EppSettings(registry=FAST_REGISTRY, picker=picker)


def num_waiting(epp: RunningEpp) -> int:
    return epp.epp.picker.admission.num_waiting(MODEL)


async def routed(epp: RunningEpp, **fields: object) -> str:
    """A request's stream, routed: the worker it names (the stream stays open, the worker held)."""
    stream = epp.stream()
    answers = await stream.request(chat_body(**fields))
    return destination_of(answers[-1])[0]


async def test_batch_requests_leave_the_reserved_slot_that_an_interactive_one_then_takes() -> None:
    """A worker of 4 slots: requests at the batch priority hold at most 3 of them (the default
    reserve, a quarter), so the 4th waits; an interactive newcomer routes at once past it to the
    reserved slot, whose end frees no slot for the batch; a batch request's end does."""
    cluster = FakeCluster([FakeWorker("w0")])
    async with running_epp(
        cluster, model_config={"max_in_flight_per_worker": 4}, settings=anonymous()
    ) as epp:
        batch = [epp.stream() for _ in range(4)]
        for stream in batch[:3]:
            answers = await stream.request(chat_body(priority=BATCH))
            assert destination_of(answers[-1])[0] == "w0.test"
        fourth = asyncio.create_task(batch[3].request(chat_body(priority=BATCH)))
        await wait_for(lambda: num_waiting(epp) == 1)
        interactive = epp.stream()
        answers = await interactive.request(chat_body())
        assert destination_of(answers[-1])[0] == "w0.test" and num_waiting(epp) == 1
        assert epp.registry.workers["w0"].in_flight_by_priority == {BATCH: 3, 0: 1}
        await interactive.response()  # the reserved slot is free again, and still not the batch's
        await asyncio.sleep(0.3)
        assert not fourth.done() and epp.in_flight() == {"w0": 3}
        await batch[0].response()  # a batch request ends: the waiting one takes its slot
        answers = await asyncio.wait_for(fourth, 5)
        assert destination_of(answers[-1])[0] == "w0.test" and num_waiting(epp) == 0
        assert epp.registry.workers["w0"].in_flight_by_priority == {BATCH: 3}
        for stream in [*batch, interactive]:
            await stream.close()


async def test_without_a_reserve_batch_requests_may_fill_every_slot() -> None:
    cluster = FakeCluster([FakeWorker("w0")])
    async with running_epp(
        cluster, model_config={"max_in_flight_per_worker": 4}, settings=anonymous(share=0.0)
    ) as epp:
        assert [await routed(epp, priority=BATCH) for _ in range(4)] == ["w0.test"] * 4
        assert epp.in_flight() == {"w0": 4}


@pytest.mark.parametrize(
    ("headroom", "kept"),
    [(IdleHeadroom(max_share=0.5), True), (IdleHeadroom(max_share=0.0), False)],
    ids=["kept", "off"],
)
async def test_batch_requests_keep_off_the_worker_an_interactive_one_is_on(
    headroom: IdleHeadroom, kept: bool
) -> None:
    """Two workers, an interactive request on one: with idle headroom (the recent peak of 1 interactive
    request, at most half the fleet) every batch request goes to the other; without, they spread."""
    cluster = FakeCluster([FakeWorker("w0"), FakeWorker("w1")])
    routing = LeastRequestRouting(strategy="least_request")
    async with running_epp(cluster, routing=routing, settings=anonymous(headroom=headroom)) as epp:
        interactive = await routed(epp)
        batch = {await routed(epp, priority=BATCH) for _ in range(4)}
        assert (interactive not in batch) is kept and len(batch) == (1 if kept else 2)


async def test_a_full_queue_sheds_the_least_urgent_with_a_429_and_releases_the_rest_when_a_slot_frees() -> (
    None
):
    """One slot, a queue of one: a batch request waits; an interactive one takes its place in line
    (the batch request gets a 429 with Retry-After); another batch request finds the line full (429);
    the interactive one routes when the slot frees."""
    cluster = FakeCluster([FakeWorker("w0")])
    async with running_epp(
        cluster, model_config={"max_in_flight_per_worker": 1}, settings=anonymous(max_size=1)
    ) as epp:
        busy = epp.stream()
        await busy.request(chat_body())
        shed = asyncio.create_task(refusal(epp, **{"x-herd-priority": str(BATCH)}))
        await wait_for(lambda: num_waiting(epp) == 1)
        interactive = epp.stream()
        waiting = asyncio.create_task(interactive.request(chat_body()))
        status, sent, error = await asyncio.wait_for(shed, 5)
        assert (status, sent["Retry-After"], error["type"]) == (429, "1", "rate_limit_error")
        assert "a more urgent request took its place in the queue" in str(error["message"])
        status, sent, error = await refusal(epp, **{"x-herd-priority": str(BATCH)})
        assert (status, sent["Retry-After"]) == (429, "1") and "its queue is full" in str(error["message"])
        assert not waiting.done() and num_waiting(epp) == 1
        await busy.response()
        answers = await asyncio.wait_for(waiting, 5)
        assert destination_of(answers[-1])[0] == "w0.test" and num_waiting(epp) == 0
        await busy.close()
        await interactive.close()
