"""Faults against real processes on loopback (issue 12, item 8): what herd does when one happens.

* A worker SIGKILLed with streams running and requests queued, with resuming off: its streams end
  with an SSE error event (tests/e2e/test_resume.py: with it on, they go on from the other worker), the queued requests (no byte answered yet) are retried on the other worker and succeed, the
  orchestrator ejects it within 2 s, and re-admits a worker started again on the same ports.
* The prefill worker SIGKILLed during a KV handoff (after its prefill, before the decode worker's
  pull): the decode worker prefills the prompt itself and answers the same greedy text.
* One bad request (token ids outside the vocabulary, deeply nested JSON) sent through the gateway to
  two workers: the client gets a 400 in the OpenAI envelope and both workers keep serving.

``herd up``'s restarts, Redis and the operator are covered by their own tests (tests/e2e/test_herd_up.py,
test_redis_replicas.py, test_operator*.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.gateway_fakes import wait_for
from support.live_cluster import (
    TOKEN,
    LiveGateway,
    WorkerPorts,
    chat_body,
    error_envelope,
    live_orchestrator,
    live_worker,
    write_manifest,
)
from support.procs import wait_until
from support.worker_server import metric_value

from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER, WORKER_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CHAT = "/v1/chat/completions"
LONG_OUTPUT = 1900
"""Tokens a stream asks for: far more than any machine decodes between its first chunk and the kill."""
KILLED, SURVIVOR = "worker-0", "worker-1"
VOCAB_SIZE = 384
"""tests/support/tiny_models.py's tokenizer size: any id from here on is outside the vocabulary."""


@dataclass
class OpenStream:
    response: httpx.Response
    lines: AsyncIterator[str]

    @property
    def worker_id(self) -> str:
        return self.response.headers[WORKER_HEADER]

    async def rest(self) -> list[Any]:
        """The remaining ``data:`` payloads until the gateway closes the stream (JSON-decoded)."""
        payloads = [line.removeprefix("data: ") async for line in self.lines if line.startswith("data: ")]
        return [payload if payload == "[DONE]" else json.loads(payload) for payload in payloads]


async def open_stream(client: httpx.AsyncClient, stack: contextlib.AsyncExitStack) -> OpenStream:
    """A long streaming chat request, once its first event has arrived."""
    body = chat_body(max_tokens=LONG_OUTPUT, ignore_eos=True, stream=True)
    response = await stack.enter_async_context(client.stream("POST", CHAT, json=body))
    assert response.status_code == 200, await response.aread()
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: "):
            return OpenStream(response, lines)
    raise AssertionError("the stream closed before its first event")


def is_healthy(gateway: LiveGateway, worker_id: str) -> bool:
    return bool(gateway.workers()[worker_id]["healthy"])


async def short_request(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post(CHAT, json=chat_body(max_tokens=3, ignore_eos=True))


@contextlib.contextmanager
def two_workers_and_gateway(
    tmp_path: Path, model: Path, ports: list[WorkerPorts], *, args: tuple[str, ...] = (), **worker_flags: str
) -> Iterator[tuple[contextlib.ExitStack, LiveGateway, list[Any]]]:
    """Two workers on ``ports`` and an orchestrator (round robin, ``args`` added) over them, all admitted."""
    engine = {"maxModelLen": int(worker_flags.get("max_model_len", "512")), "kvCache": {"memoryGiB": 0.05}}
    if "max_batch_size" in worker_flags:
        engine["maxBatchSize"] = int(worker_flags["max_batch_size"])
    manifest = write_manifest(tmp_path, model, engine=engine, routing="round_robin")
    with contextlib.ExitStack() as stack:
        processes = [
            stack.enter_context(live_worker(model, port, log=tmp_path / f"worker{n}.log", **worker_flags))
            for n, port in enumerate(ports)
        ]
        gateway = stack.enter_context(
            live_orchestrator(manifest, ports, log=tmp_path / "orchestrator.log", args=args)
        )
        gateway.wait_all_healthy(len(ports))
        yield stack, gateway, processes


async def test_a_worker_killed_mid_stream_fails_its_streams_only_and_comes_back(
    tmp_path: Path, tiny_llama: Path
) -> None:
    ports = [WorkerPorts.fresh(), WorkerPorts.fresh()]
    flags = {"max_model_len": "2048", "max_batch_size": "2"}  # two streams fill a worker; more wait
    no_resume = ("--max-resumes", "0")  # the rule for streams no worker may resume (tests/e2e/test_resume.py)
    with two_workers_and_gateway(tmp_path, tiny_llama, ports, args=no_resume, **flags) as (
        stack,
        gateway,
        processes,
    ):
        async with (
            httpx.AsyncClient(base_url=gateway.url, timeout=60) as client,
            contextlib.AsyncExitStack() as streams_stack,
        ):
            streams = [await open_stream(client, streams_stack) for _ in range(4)]  # round robin: 2 each
            assert sorted(stream.worker_id for stream in streams) == [KILLED, KILLED, SURVIVOR, SURVIVOR]
            queued = [asyncio.create_task(short_request(client)) for _ in range(4)]
            await wait_for(lambda: ports[0].load()["num_waiting"] == 2, within=30)

            os.kill(processes[0].pid, signal.SIGKILL)
            killed_at = time.monotonic()
            await wait_for(lambda: not is_healthy(gateway, KILLED), within=10)
            ejected_after = time.monotonic() - killed_at
            for stream in streams:
                if stream.worker_id == KILLED:
                    events = await stream.rest()
                    assert events and isinstance(events[-1], dict) and "error" in events[-1], events[-3:]
                    assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
                    assert "[DONE]" not in events
                else:
                    await stream.response.aclose()  # frees the survivor's batch for the queued requests
            answers = await asyncio.gather(*queued)
        assert [answer.status_code for answer in answers] == [200] * 4, [a.text for a in answers]
        assert {answer.headers[WORKER_HEADER] for answer in answers} == {SURVIVOR}
        print(f"fault kill -9 mid-stream: {KILLED} ejected {ejected_after:.2f}s after the kill")
        assert ejected_after <= 2.0

        stack.enter_context(live_worker(tiny_llama, ports[0], log=tmp_path / "worker0-again.log", **flags))
        await wait_for(lambda: is_healthy(gateway, KILLED), within=30)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            again = [await short_request(client) for _ in range(4)]
        served_by = {answer.headers[WORKER_HEADER] for answer in again}
        assert served_by == {KILLED, SURVIVOR}


def kv_blocks_received(worker: WorkerPorts) -> float:
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if 'direction="received"' in line]
    return metric_value("\n".join(lines), "herd_kv_transfer_blocks_total") if lines else 0.0


def test_the_decode_worker_prefills_itself_when_the_prefill_worker_dies_during_the_handoff(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """The test plays the orchestrator's two phases so that the kill lands exactly between them."""
    prefill, decode = WorkerPorts.fresh("prefill"), WorkerPorts.fresh("decode")
    prompt = " ".join(f"item{number % 23} costs {number} coins" for number in range(24))
    body = chat_body(prompt, max_tokens=8, temperature=0, ignore_eos=True)
    with (
        live_worker(tiny_llama, prefill, log=tmp_path / "prefill.log") as prefill_process,
        live_worker(tiny_llama, decode, log=tmp_path / "decode.log"),
    ):
        asked = {**body, "kv_transfer_params": {"do_remote_decode": True}}
        handoff = httpx.post(prefill.internal_url + INTERNAL_PATHS.prefill, json=asked,
                             headers={TOKEN_HEADER: TOKEN}, timeout=60)  # fmt: skip
        assert handoff.status_code == 200, handoff.text
        params = handoff.json()
        assert params["remote_block_ids"], "the prompt must span full blocks for a handoff to happen"
        os.kill(prefill_process.pid, signal.SIGKILL)
        prefill_process.wait(timeout=10)

        received = kv_blocks_received(decode)
        handed = {**body, "kv_transfer_params": params}
        answer = httpx.post(decode.url + CHAT, json=handed, headers={TOKEN_HEADER: TOKEN}, timeout=60)
        assert answer.status_code == 200, answer.text
        reference = httpx.post(decode.url + CHAT, json=body, timeout=60).json()
        assert answer.json()["choices"][0]["message"] == reference["choices"][0]["message"]
        assert kv_blocks_received(decode) == received
        total = decode.load()["num_total_blocks"]
        wait_until(
            lambda: decode.num_free_blocks() == total, timeout=30, what="the decode worker's blocks free"
        )


DEEP = 100_000
BAD_REQUESTS = {
    "negative-logit-bias-id": (json.dumps(chat_body(logit_bias={"-1": 1})), "logit_bias"),
    "logit-bias-id-past-vocab": (json.dumps(chat_body(logit_bias={str(VOCAB_SIZE + 7): 1})), "logit_bias"),
    "stop-token-id-past-vocab-with-min-tokens": (
        json.dumps(chat_body(stop_token_ids=[VOCAB_SIZE + 7], min_tokens=2)),
        "stop_token_ids",
    ),
    "deeply-nested-json": (json.dumps(chat_body())[:-1] + ', "user": ' + "[" * DEEP + "]" * DEEP + "}", None),
}


@pytest.fixture
def pair(tmp_path: Path, tiny_llama: Path) -> Iterator[tuple[LiveGateway, list[WorkerPorts]]]:
    ports = [WorkerPorts.fresh(), WorkerPorts.fresh()]
    with two_workers_and_gateway(tmp_path, tiny_llama, ports) as (_, gateway, _processes):
        yield gateway, ports


@pytest.mark.parametrize(("body", "param"), list(BAD_REQUESTS.values()), ids=list(BAD_REQUESTS))
def test_one_bad_request_is_a_400_and_takes_no_worker_down(
    pair: tuple[LiveGateway, list[WorkerPorts]], body: str, param: str | None
) -> None:
    gateway, ports = pair
    for _ in range(len(ports)):  # round robin: every worker would get it if the gateway passed it on
        response = httpx.post(gateway.url + CHAT, content=body, headers={"content-type": "application/json"},
                              timeout=60)  # fmt: skip
        assert response.status_code == 400, response.text[:500]
        error = error_envelope(response)
        if param is not None:
            assert error["param"] == param, error
    for worker in ports:
        assert httpx.get(f"{worker.url}/health", timeout=10).status_code == 200
        assert httpx.post(worker.url + CHAT, json=chat_body(), timeout=60).status_code == 200
    assert all(row["healthy"] for row in gateway.workers().values()), gateway.workers()
    served_by = {httpx.post(gateway.url + CHAT, json=chat_body(), timeout=60).headers[WORKER_HEADER]
                 for _ in range(len(ports))}  # fmt: skip
    assert served_by == {KILLED, SURVIVOR}
