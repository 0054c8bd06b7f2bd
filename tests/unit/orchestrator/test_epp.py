"""``herd epp`` speaks the Endpoint Picker protocol over ext_proc: a gRPC client plays Envoy's filter
against the real server, over fake workers (``httpx.MockTransport``).

The choice is named the same way in the destination header and the ``envoy.lb`` metadata, in either
body mode; the subset hint restricts it; refusals are immediate responses in the OpenAI envelope (404,
400, 503 with Retry-After, 429 when full); the chosen worker is held until the response's end, or the
stream's; an endpoint the data plane reports as served takes the hold; the health services follow
the discovery's sync.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, ProcessingRequest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.epp_fakes import (
    FULL_DUPLEX,
    RunningEpp,
    chat_body,
    destination_of,
    headers_message,
    response_headers_message,
    running_epp,
)
from support.gateway_fakes import FAST_REGISTRY, FakeCluster, FakeWorker, wait_for

from herd.api.crd import KVCacheAwareRouting
from herd.api.kv_hash import block_hashes
from herd.api.prompt import PromptRenderer
from herd.orchestrator.admission.waiting import QueueSettings
from herd.orchestrator.discovery import Membership
from herd.orchestrator.epp.picker import PickerSettings
from herd.orchestrator.epp.server import EXT_PROC_SERVICE, EppSettings, build_epp
from herd.orchestrator.state import MemoryState
from herd.orchestrator.tokens import prompt_token_ids
from herd.orchestrator.validation import parse_request


def _cluster(num: int = 2) -> FakeCluster:
    return FakeCluster([FakeWorker(f"w{n}") for n in range(num)])


@pytest.mark.parametrize("request_mode", ["buffered", "full_duplex"])
async def test_the_choice_is_named_in_header_and_metadata_and_held_until_the_response_ends(
    request_mode: str,
) -> None:
    async with running_epp(_cluster()) as epp:
        stream = epp.stream(request_mode=FULL_DUPLEX) if request_mode == "full_duplex" else epp.stream()
        body = chat_body("x" * 150_000)  # more than one 62 kB chunk back in full duplex
        answers = await stream.request(body, chunks=3 if request_mode == "full_duplex" else 1)
        chosen = answers[0] if request_mode == "full_duplex" else answers[-1]
        header, metadata = destination_of(chosen)
        assert header == metadata and header in {"w0.test", "w1.test"}
        assert chosen.HasField("request_headers" if request_mode == "full_duplex" else "request_body")
        if request_mode == "full_duplex":  # Envoy forwards only the body the picker hands back
            streamed = b"".join(
                a.request_body.response.body_mutation.streamed_response.body for a in answers[1:]
            )
            assert streamed == body
        worker_id = header.removesuffix(".test")
        assert epp.in_flight()[worker_id] == 1
        response = await stream.response(body_chunks=[b"data: 1\n\n", b"data: [DONE]\n\n"])
        added = {
            h.header.key: h.header.raw_value
            for h in response[0].response_headers.response.header_mutation.set_headers
        }
        assert added == {"X-Herd-Worker": worker_id.encode()}
        assert epp.in_flight()[worker_id] == 0
        await stream.close()


async def test_requests_spread_as_the_strategy_says_while_held() -> None:
    async with running_epp(_cluster(3)) as epp:
        streams = [epp.stream() for _ in range(3)]
        chosen = [destination_of((await s.request(chat_body()))[-1])[0] for s in streams]
        assert sorted(chosen) == ["w0.test", "w1.test", "w2.test"]  # round robin, each held
        assert epp.in_flight() == {"w0": 1, "w1": 1, "w2": 1}
        for stream in streams:
            await stream.close()  # Envoy ends the streams (the client left): every hold is released
        await wait_for(lambda: set(epp.in_flight().values()) == {0})


@pytest.mark.parametrize(
    "subset",
    [["w1.test"], "w2.test, w1.test", ["w1.test,w2.test"]],
    ids=["list", "comma-string", "list-of-comma-strings"],
)
async def test_the_subset_hint_restricts_the_choice(subset: object) -> None:
    async with running_epp(_cluster(3)) as epp:
        allowed = {"w1.test", "w2.test"} if "w2" in str(subset) else {"w1.test"}
        for _ in range(4):
            stream = epp.stream()
            answers = await stream.request(chat_body(), subset=subset)
            assert destination_of(answers[-1])[0] in allowed
            await stream.close()


async def _refusal(
    epp: RunningEpp, body: bytes, **kwargs: object
) -> tuple[int, dict[str, str], dict[str, object]]:
    stream = epp.stream()
    answers = await stream.request(body, **kwargs)  # type: ignore[arg-type]
    immediate = answers[-1].immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    await stream.close()
    return immediate.status.code, headers, json.loads(immediate.body)["error"]


async def test_no_ready_endpoint_in_the_subset_is_a_503_with_retry_after() -> None:
    async with running_epp(_cluster()) as epp:
        status, headers, error = await _refusal(epp, chat_body(), subset=["10.0.0.9:8000"])
        assert (status, headers["Retry-After"]) == (503, "1")
        assert "no ready worker among the 1 endpoints of the gateway's subset" in str(error["message"])
        status, _, _ = await _refusal(epp, chat_body(), subset=[])
        assert status == 503


async def test_no_healthy_worker_is_503_and_every_worker_full_is_429() -> None:
    cluster = FakeCluster([FakeWorker("w0")])
    short_wait = PickerSettings(queue=QueueSettings(max_wait_seconds=0.2))  # the queue's limit, then 429
    settings = EppSettings(registry=FAST_REGISTRY, picker=short_wait)
    async with running_epp(cluster, model_config={"max_in_flight_per_worker": 1}, settings=settings) as epp:
        held = epp.stream()
        await held.request(chat_body())
        status, headers, error = await _refusal(epp, chat_body())
        assert (status, headers["Retry-After"], headers["content-type"]) == (429, "1", "application/json")
        assert "at capacity" in str(error["message"])
        await held.close()
        cluster.workers[0].is_ready = False
        await wait_for(lambda: not epp.registry.workers["w0"].is_healthy)
        status, _, error = await _refusal(epp, chat_body())
        assert status == 503 and "no ready worker" in str(error["message"])


@pytest.mark.parametrize(
    ("body", "path", "status", "param"),
    [
        (chat_body(model="other"), "/v1/chat/completions", 404, "model"),
        (b"{not json", "/v1/chat/completions", 400, None),
        (json.dumps({"model": "tiny"}).encode(), "/v1/chat/completions", 400, "messages"),
        (chat_body(), "/v1/rerank", 404, None),
    ],
    ids=["unknown-model", "bad-json", "missing-messages", "other-route"],
)
async def test_bad_requests_get_the_openai_envelope(
    body: bytes, path: str, status: int, param: str | None
) -> None:
    async with running_epp(_cluster()) as epp:
        stream = epp.stream()
        await stream.send(headers_message(path, protocol=stream.protocol))
        answer = await stream.read()
        if answer.HasField("request_headers"):  # the route is one the picker serves: the body decides
            await stream.send(ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)))
            answer = await stream.read()
        assert answer.immediate_response.status.code == status
        error = json.loads(answer.immediate_response.body)["error"]
        assert error["param"] == param and error["message"]
        assert set(epp.in_flight().values()) == {0}
        await stream.close()


async def test_a_body_before_its_headers_is_a_400_and_the_stream_goes_on() -> None:
    async with running_epp(_cluster()) as epp:
        stream = epp.stream()
        await stream.send(ProcessingRequest(request_body=HttpBody(body=chat_body(), end_of_stream=True)))
        answer = await stream.read()
        assert answer.immediate_response.status.code == 400
        assert "before its headers" in json.loads(answer.immediate_response.body)["error"]["message"]
        await stream.close()


async def test_a_body_that_ends_twice_is_routed_and_held_once() -> None:
    async with running_epp(_cluster()) as epp:
        stream = epp.stream()
        chosen = destination_of((await stream.request(chat_body()))[-1])[0].removesuffix(".test")
        for _ in range(2):  # Envoy would not send these; a broken filter might
            await stream.send(ProcessingRequest(request_body=HttpBody(body=b"", end_of_stream=True)))
            assert (await stream.read()).HasField("request_body")
        assert epp.in_flight()[chosen] == 1 and sum(epp.in_flight().values()) == 1
        await stream.send(response_headers_message(status="abc"))  # not a number: read as no status
        assert (await stream.read()).HasField("response_headers")
        await stream.close()
        await wait_for(lambda: set(epp.in_flight().values()) == {0})


async def test_the_endpoint_the_data_plane_served_on_takes_the_hold() -> None:
    async with running_epp(_cluster()) as epp:
        stream = epp.stream()
        batch = chat_body(priority=1000)  # the hold keeps its priority, for the slot reserve
        chosen = destination_of((await stream.request(batch))[-1])[0].removesuffix(".test")
        other = "w1" if chosen == "w0" else "w0"
        await stream.send(response_headers_message(served=f"{other}.test"))
        answer = await stream.read()
        added = answer.response_headers.response.header_mutation.set_headers
        assert [(h.header.key, h.header.raw_value) for h in added] == [("X-Herd-Worker", other.encode())]
        assert epp.in_flight() == {chosen: 0, other: 1}
        assert epp.registry.workers[other].in_flight_by_priority == {1000: 1}
        await stream.close()
        await wait_for(lambda: set(epp.in_flight().values()) == {0})


async def test_kv_cache_aware_picks_the_worker_holding_the_prompt(tiny_llama: Path) -> None:
    renderer = PromptRenderer.from_pretrained(tiny_llama)
    body = chat_body("the same long system prompt " * 20, max_tokens=2)
    parsed = parse_request("/v1/chat/completions", body)
    hashes = block_hashes(prompt_token_ids(renderer, parsed.request, max_model_len=4096), 16, model_id="tiny")
    cluster = FakeCluster([FakeWorker("w0"), FakeWorker("w1", snapshot_blocks=list(hashes))])
    routing = KVCacheAwareRouting(strategy="kv_cache_aware")
    async with running_epp(cluster, routing=routing, model_config={"model_path": tiny_llama}) as epp:
        index = epp.registry.models["tiny"].kv_index
        await wait_for(lambda: index.match(hashes).get("w1", 0) == len(hashes))
        stream = epp.stream()
        assert destination_of((await stream.request(body))[-1])[0] == "w1.test"
        await stream.close()


async def test_health_serves_liveness_at_once_and_readiness_once_synced() -> None:
    async with running_epp(_cluster()) as epp:
        stub = health_pb2_grpc.HealthStub(epp.channel)
        for service in ("liveness", "readiness", EXT_PROC_SERVICE):
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.Check(health_pb2.HealthCheckRequest(service="nothing"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


class _NeverSyncs:
    async def watch(self) -> AsyncIterator[Membership]:
        await asyncio.Event().wait()
        yield Membership()


async def test_readiness_waits_for_the_discovery_while_liveness_serves() -> None:
    epp = build_epp(host="127.0.0.1", port=0, state=MemoryState())
    task = asyncio.create_task(epp.run(_NeverSyncs()))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest
            await wait_for(lambda: epp.server is not None)
            live = await stub.Check(check(service="liveness"), wait_for_ready=True)
            ready = await stub.Check(check(service="readiness"))
            assert (live.status, ready.status) == (
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,
            )
    finally:
        await epp.server.stop(0)
        await task
