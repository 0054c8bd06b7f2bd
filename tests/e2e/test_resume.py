"""Streams survive a dead worker (issue 21, item 6): real ``herd worker`` and ``herd orchestrator``
processes on loopback; the worker serving a stream is SIGKILLed after its first tokens reached the
client, and the client's stream goes on from the other worker as one stream: the same id, ``created``
and choice indexes, the same text and finish reasons as an undisturbed run of the same request, and
usage counting every token. Greedy, seeded sampling, a JSON-schema-constrained request, and ``n = 2``
seeded completions; the killed worker is started again on its ports after each case."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.gateway_fakes import wait_for
from support.live_cluster import (
    MODEL,
    LiveGateway,
    WorkerPorts,
    chat_body,
    live_orchestrator,
    live_worker,
    write_manifest,
)
from support.worker_server import metric_value

from herd.api.protocol import WORKER_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 20},
        "lines": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 12,
            "maxItems": 12,
        },
    },
    "required": ["title", "lines"],
    "additionalProperties": False,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "greedy-chat": ("/v1/chat/completions", chat_body(max_tokens=160, temperature=0, ignore_eos=True)),
    "seeded-chat": (
        "/v1/chat/completions",
        chat_body(
            max_tokens=160, temperature=1.0, top_p=0.9, seed=1234, presence_penalty=0.5, ignore_eos=True
        ),
    ),
    "json-schema-chat": (
        "/v1/chat/completions",
        chat_body(
            max_tokens=400,
            temperature=0.8,
            seed=99,
            response_format={"type": "json_schema", "json_schema": {"name": "poem", "schema": SCHEMA}},
        ),
    ),
    "n2-seeded-completions": (
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "Once upon a time",
            "n": 2,
            "max_tokens": 120,
            "temperature": 0.9,
            "seed": 7,
            "stop": [" the end"],
            "ignore_eos": True,
        },
    ),
}


@dataclass
class Streamed:
    """What a client read from one stream."""

    worker_id: str
    ids: set[str] = field(default_factory=set)
    created: set[int] = field(default_factory=set)
    texts: dict[int, str] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    is_done: bool = False
    num_role_chunks: int = 0

    def add(self, chunk: dict[str, Any]) -> None:
        assert "error" not in chunk, chunk
        self.ids.add(chunk["id"])
        self.created.add(chunk["created"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk["choices"]:
            index = choice["index"]
            delta = choice.get("delta", {})
            self.num_role_chunks += delta.get("role") is not None
            text = delta.get("content") if "delta" in choice else choice.get("text")
            self.texts[index] = self.texts.get(index, "") + (text or "")
            if choice.get("finish_reason"):
                assert index not in self.finish_reasons, f"choice {index} finished twice"
                self.finish_reasons[index] = choice["finish_reason"]


async def read(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], *, kill: Kill | None = None
) -> Streamed:
    """Stream ``body``; with ``kill``, SIGKILL the serving worker once a few content events are in."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        streamed = Streamed(response.headers[WORKER_HEADER])
        num_events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                assert not line.startswith(":"), f"a comment reached the client: {line}"
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                streamed.is_done = True
                continue
            assert not streamed.is_done, "an event after [DONE]"
            streamed.add(json.loads(payload))
            num_events += 1
            if kill is not None and num_events == 6:
                kill(streamed.worker_id)
    return streamed


class Kill:
    """SIGKILLs a worker by its gateway id and remembers which."""

    def __init__(self, processes: dict[str, Any]) -> None:
        self.processes = processes
        self.killed: str | None = None

    def __call__(self, worker_id: str) -> None:
        os.kill(self.processes[worker_id].pid, signal.SIGKILL)
        self.killed = worker_id


@dataclass
class Cluster:
    stack: contextlib.ExitStack
    gateway: LiveGateway
    ports: dict[str, WorkerPorts]
    processes: dict[str, Any]
    model: Path
    folder: Path

    def num_resumed(self) -> float:
        text = httpx.get(f"{self.gateway.url}/metrics", timeout=10).text
        lines = [line for line in text.splitlines() if 'outcome="resumed"' in line]
        return metric_value("\n".join(lines), "herd_router_stream_resumes_total") if lines else 0.0

    def restart(self, worker_id: str) -> None:
        log = self.folder / f"{worker_id}-again-{os.urandom(2).hex()}.log"
        self.processes[worker_id] = self.stack.enter_context(
            live_worker(self.model, self.ports[worker_id], log=log)
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("resume")
    ports = {f"worker-{n}": WorkerPorts.fresh() for n in range(2)}
    manifest = write_manifest(
        folder, tiny_llama, engine={"maxModelLen": 512, "kvCache": {"memoryGiB": 0.05}}, routing="round_robin"
    )
    with contextlib.ExitStack() as stack:
        processes = {
            worker_id: stack.enter_context(live_worker(tiny_llama, port, log=folder / f"{worker_id}.log"))
            for worker_id, port in ports.items()
        }
        gateway = stack.enter_context(
            live_orchestrator(manifest, list(ports.values()), log=folder / "orchestrator.log")
        )
        gateway.wait_all_healthy(len(ports))
        yield Cluster(stack, gateway, ports, processes, tiny_llama, folder)


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=cluster.gateway.url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("case", CASES)
async def test_a_stream_whose_worker_is_killed_completes_as_an_undisturbed_one(
    cluster: Cluster, client: httpx.AsyncClient, case: str
) -> None:
    path, body = CASES[case]
    undisturbed = await read(client, path, body)
    resumed_before = cluster.num_resumed()
    kill = Kill(cluster.processes)
    disturbed = await read(client, path, body, kill=kill)
    assert kill.killed == disturbed.worker_id
    try:
        assert disturbed.is_done and undisturbed.is_done
        assert len(disturbed.ids) == 1 and len(disturbed.created) == 1, (disturbed.ids, disturbed.created)
        assert disturbed.texts == undisturbed.texts
        assert disturbed.finish_reasons == undisturbed.finish_reasons
        assert disturbed.usage is not None and undisturbed.usage is not None
        assert disturbed.usage["completion_tokens"] == undisturbed.usage["completion_tokens"]
        assert disturbed.usage["prompt_tokens"] == undisturbed.usage["prompt_tokens"]
        assert disturbed.num_role_chunks == undisturbed.num_role_chunks
        if case == "json-schema-chat":
            assert set(json.loads(disturbed.texts[0])) == {"title", "lines"}
        assert cluster.num_resumed() == resumed_before + 1
    finally:
        cluster.restart(kill.killed)
        await wait_for(lambda: cluster.gateway.workers()[kill.killed]["healthy"], within=30)
