"""Fake workers behind ``httpx.MockTransport`` for orchestrator unit tests (no sockets).

Each ``FakeWorker`` answers the public and internal worker contract for one host; its fields
switch behaviours (down, not ready, an error status, dropping the connection before answering,
failing mid-stream) and record what it saw. Like a real worker, it sends ``Retry-After`` with 429
and 503 (``retry_after``; ``None`` leaves it out).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI

from herd.api.crd import RoundRobinRouting, RoutingSpec
from herd.api.openai import ErrorResponse
from herd.api.protocol import INTERNAL_PATHS, KVEvent, KVSnapshot, LoadReport, Role, StatusQuery
from herd.api.worker_status import StatusSource, status_lines
from herd.orchestrator.app import AppSettings, build_app
from herd.orchestrator.discovery import ModelConfig, StaticSource, WorkerEndpoint
from herd.orchestrator.registry import RegistrySettings
from herd.orchestrator.worker_client import LORA_PATHS
from support.upstream_fakes import HttpxUpstream

MODEL = "tiny"


class FakeStream(httpx.AsyncByteStream):
    """SSE chunks with a pause between them; can fail after ``fail_after`` chunks; records closing."""

    def __init__(
        self, chunks: list[bytes], *, delay: float, fail_after: int | None, worker: FakeWorker
    ) -> None:
        self.chunks, self.delay, self.fail_after, self.worker = chunks, delay, fail_after, worker

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for number, chunk in enumerate(self.chunks):
            if number == self.fail_after:
                raise httpx.RemoteProtocolError("peer closed connection (fake worker killed)")
            if number:
                await asyncio.sleep(self.delay)
            yield chunk

    async def aclose(self) -> None:
        self.worker.num_streams_closed += 1


class FakeStatusStream(httpx.AsyncByteStream):
    """The worker's status stream (``herd.api.worker_status``, as real workers serve it) over the
    fake's fields; it breaks as a killed process's would once the fake goes down, and stalls (sends
    nothing, keeps the connection) while ``is_stalled``."""

    def __init__(self, worker: FakeWorker, query: StatusQuery) -> None:
        self.worker, self.query = worker, query

    async def __aiter__(self) -> AsyncIterator[bytes]:
        worker = self.worker
        async for line in status_lines(worker.status_source(), self.query):
            await asyncio.sleep(worker.line_delay)
            for _ in range(60_000):  # a stall lasts at most 10 minutes
                if not (worker.is_stalled and worker.is_up):
                    break
                await asyncio.sleep(0.01)
            if not worker.is_up:
                raise httpx.RemoteProtocolError("peer closed connection (fake worker killed)")
            worker.num_status_lines += 1
            yield line


@dataclass(eq=False)
class FakeWorker:
    id: str
    role: Role = "unified"
    is_up: bool = True
    is_ready: bool = True
    status: int = 200
    retry_after: str | None = "1"
    is_dropping: bool = False
    """Close the connection without answering (a process killed with the request queued)."""
    fail_after_chunks: int | None = None
    chunk_delay: float = 0.0
    num_chunks: int = 3
    load: LoadReport = field(default_factory=LoadReport)
    epoch: str = "e1"
    events: list[KVEvent] = field(default_factory=list)
    snapshot_blocks: list[int] = field(default_factory=list)
    is_stalled: bool = False
    """Keep the status stream open but send nothing (a hung process)."""
    line_delay: float = 0.0
    """Seconds each status line is late (a slow worker, or a busy one)."""
    metrics: str = ""
    """The Prometheus text its ``/metrics`` answers."""
    prefill_delay: float = 0.0
    """How long ``/internal/prefill`` takes to answer (a prefill in progress)."""
    prefills: list[dict[str, object]] = field(default_factory=list)
    """The bodies ``/internal/prefill`` received."""
    bodies: list[dict[str, object]] = field(default_factory=list)
    """The OpenAI request bodies it received."""
    lora_status: int = 200
    """What its runtime LoRA routes answer (200: the change is made)."""
    adapters: list[str] = field(default_factory=list)
    """The LoRA adapters loaded on it at runtime."""
    lora_changes: list[str] = field(default_factory=list)
    """Every runtime LoRA call it received, as ``"<load|unload> <name>"``."""
    num_requests: int = 0
    num_snapshots: int = 0
    num_status_streams: int = 0
    num_status_lines: int = 0
    num_streams_closed: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.id}.test"

    @property
    def endpoint(self) -> WorkerEndpoint:
        return WorkerEndpoint(self.id, MODEL, self.url, f"http://{self.id}.internal", self.role)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.is_up:
            raise httpx.ConnectError("connection refused (fake worker down)", request=request)
        path = request.url.path
        if path == "/ready":
            return httpx.Response(200 if self.is_ready else 503)
        if path == "/metrics":
            return httpx.Response(200, text=self.metrics)
        if path.startswith("/internal/"):
            return self._internal(request)
        if path in LORA_PATHS.values():
            return self._change_lora(path, json.loads(request.content))
        self.num_requests += 1
        if self.is_dropping:
            raise httpx.RemoteProtocolError(
                "Server disconnected without sending a response.", request=request
            )
        self.bodies.append(json.loads(request.content))
        return self._completion(self.bodies[-1])

    def _internal(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == INTERNAL_PATHS.prefill:
            return self._prefill(json.loads(request.content))
        if path == INTERNAL_PATHS.status:
            self.num_status_streams += 1
            query = StatusQuery.model_validate(dict(request.url.params))
            stream = FakeStatusStream(self, query)
            return httpx.Response(200, headers={"content-type": "application/x-ndjson"}, stream=stream)
        return httpx.Response(404)

    def _change_lora(self, path: str, body: dict[str, str]) -> httpx.Response:
        action = next(action for action, route in LORA_PATHS.items() if route == path)
        self.lora_changes.append(f"{action} {body['lora_name']}")
        if self.lora_status != 200:
            error = ErrorResponse.of(self.lora_status, f"fake worker {self.id} refuses the adapter")
            return httpx.Response(self.lora_status, json=error.model_dump())
        name = body["lora_name"]
        if action == "load":
            self.adapters.append(name)
        elif name in self.adapters:
            self.adapters.remove(name)
        return httpx.Response(200, text="Success")

    def status_source(self) -> StatusSource:
        async def probe() -> tuple[bool, LoadReport]:
            return self.is_ready, self.load

        async def events_after(seq: int, wait: float) -> list[KVEvent]:
            for _ in range(max(1, round(wait / 0.005))):  # a poll of the list stands in for a wakeup
                if events := [event for event in self.events if event.seq > seq]:
                    return events
                await asyncio.sleep(0.005)
            return [event for event in self.events if event.seq > seq]

        async def snapshot() -> KVSnapshot:
            self.num_snapshots += 1
            seq = self.events[-1].seq if self.events else 0
            return KVSnapshot(epoch=self.epoch, seq=seq, block_size=4, block_hashes=self.snapshot_blocks)

        return StatusSource(lambda: self.epoch, probe, events_after, snapshot)

    def _prefill(self, payload: dict[str, object]) -> httpx.Response:
        """A prefill's ``kv_transfer_params`` after ``prefill_delay`` (the body's halves apart)."""
        self.prefills.append(payload)
        params = {"do_remote_prefill": True, "remote_host": f"{self.id}.internal", "remote_port": 80}
        body = json.dumps({**params, "remote_request_id": f"prefill-{len(self.prefills)}"}).encode()
        stream = FakeStream([body[:1], body[1:]], delay=self.prefill_delay, fail_after=None, worker=self)
        return httpx.Response(200, headers={"content-type": "application/json"}, stream=stream)

    def _completion(self, payload: dict[str, object]) -> httpx.Response:
        if self.status != 200:
            error = ErrorResponse.of(self.status, f"fake worker {self.id} answers {self.status}").model_dump()
            headers = (
                {"retry-after": self.retry_after} if self.retry_after and self.status in (429, 503) else {}
            )
            return self._streamed(self.status, [json.dumps(error).encode()], "application/json", headers)
        if not payload.get("stream"):
            usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
            body = json.dumps({"id": "x", "worker": self.id, "choices": [], "usage": usage}).encode()
            return self._streamed(200, [body], "application/json")
        chunks = [f'data: {{"n": {n}, "worker": "{self.id}"}}\n\n'.encode() for n in range(self.num_chunks)]
        return self._streamed(200, [*chunks, b"data: [DONE]\n\n"], "text/event-stream")

    def _streamed(
        self, status: int, chunks: list[bytes], content_type: str, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        # A stream, not `content=`: MockTransport would hand back an already-read body otherwise.
        stream = FakeStream(chunks, delay=self.chunk_delay, fail_after=self.fail_after_chunks, worker=self)
        return httpx.Response(
            status, headers={"content-type": content_type, **(headers or {})}, stream=stream
        )


@dataclass(eq=False)
class FakeCluster:
    workers: list[FakeWorker]

    def transport(self) -> httpx.MockTransport:
        by_host = {}
        for worker in self.workers:
            by_host[f"{worker.id}.test"] = worker
            by_host[f"{worker.id}.internal"] = worker

        def handle(request: httpx.Request) -> httpx.Response:
            return by_host[request.url.host].handle(request)

        return httpx.MockTransport(handle)

    def source(self, routing: RoutingSpec | None = None, **config: object) -> StaticSource:
        model = ModelConfig(MODEL, routing or RoundRobinRouting(strategy="round_robin"), **config)  # type: ignore[arg-type]
        return StaticSource([model], [worker.endpoint for worker in self.workers])


FAST_REGISTRY = RegistrySettings(poll_interval=0.02, failures_to_eject=2)


@contextlib.asynccontextmanager
async def running_gateway(
    cluster: FakeCluster,
    *,
    routing: RoutingSpec | None = None,
    settings: AppSettings | None = None,
    model_config: Mapping[str, object] | None = None,
    **kwargs: object,
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The orchestrator app over ``cluster``, started, with every up worker admitted;
    ``model_config`` sets ``ModelConfig`` fields (a model folder, maxModelLen, ...)."""
    upstream = httpx.AsyncClient(transport=cluster.transport())
    settings = settings or AppSettings(registry=FAST_REGISTRY)
    app = build_app(
        cluster.source(routing, **(model_config or {})),
        settings=settings,
        http=upstream,
        upstream=HttpxUpstream(upstream),
        **kwargs,
    )  # type: ignore[arg-type]
    registry = app.state.registry
    try:
        async with app.router.lifespan_context(app):
            await wait_for(
                lambda: (
                    len(registry.workers) == len(cluster.workers)
                    and all(w.is_healthy for w in registry.workers.values() if _is_up(cluster, w.endpoint.id))
                )
            )
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://orchestrator"
            ) as client:
                yield app, client
    finally:
        await upstream.aclose()


def _is_up(cluster: FakeCluster, worker_id: str) -> bool:
    return next(worker for worker in cluster.workers if worker.id == worker_id).is_up


async def wait_for(check: Callable[[], bool], *, within: float = 30.0) -> float:
    """Poll ``check()`` until true; returns the seconds it took; bounded by ``within`` seconds."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while loop.time() - start < within:
        if check():
            return loop.time() - start
        await asyncio.sleep(0.01)
    raise TimeoutError(f"condition not met within {within}s")


def sse_events(body: bytes) -> Iterator[str]:
    """The ``data:`` payloads of an SSE body, undecoded."""
    # split("\n"), not splitlines(): a token's text may hold U+2028 or U+0085, which splitlines breaks on.
    for line in body.decode().split("\n"):
        if line.startswith("data: "):
            yield line.removeprefix("data: ").rstrip("\r")
