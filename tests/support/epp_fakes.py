"""Playing Envoy against ``herd epp`` in process: the picker over fake workers, and an ext_proc stream
driven message by message (what Envoy's ext_proc filter sends, in its order)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub
from google.protobuf.struct_pb2 import Struct

from herd.api.crd import RoutingSpec
from herd.orchestrator.epp import EppSettings
from herd.orchestrator.epp.server import Epp, build_epp
from herd.orchestrator.state import MemoryState
from support.gateway_fakes import FAST_REGISTRY, MODEL, FakeCluster, wait_for

BUFFERED = ProcessingMode.BodySendMode.BUFFERED
FULL_DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
STREAMED = ProcessingMode.BodySendMode.STREAMED


@dataclass(eq=False)
class RunningEpp:
    epp: Epp
    channel: grpc.aio.Channel

    @property
    def registry(self) -> Any:
        return self.epp.registry

    def stream(self, *, request_mode: int = BUFFERED, response_mode: int = STREAMED) -> EnvoyStream:
        return EnvoyStream(ExternalProcessorStub(self.channel).Process(), request_mode, response_mode)

    def in_flight(self) -> dict[str, int]:
        return {worker_id: worker.num_in_flight for worker_id, worker in self.registry.workers.items()}


@contextlib.asynccontextmanager
async def running_epp(
    cluster: FakeCluster,
    *,
    routing: RoutingSpec | None = None,
    model_config: Mapping[str, object] | None = None,
    settings: EppSettings | None = None,
) -> AsyncIterator[RunningEpp]:
    """The endpoint picker on a free loopback port over ``cluster``, every up worker admitted."""
    http = httpx.AsyncClient(transport=cluster.transport())
    epp = build_epp(
        host="127.0.0.1",
        port=0,
        state=MemoryState(),
        settings=settings or EppSettings(registry=FAST_REGISTRY),
        http=http,
    )
    task = asyncio.create_task(epp.run(cluster.source(routing, **(model_config or {}))))
    try:
        up = [worker.id for worker in cluster.workers if worker.is_up and worker.is_ready]
        registry = epp.registry
        await wait_for(lambda: all(w in registry.workers and registry.workers[w].is_healthy for w in up))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
            yield RunningEpp(epp, channel)
    finally:
        await epp.server.stop(0)
        await task
        await http.aclose()


def headers_message(
    path: str = "/v1/chat/completions",
    *,
    method: str = "POST",
    extra: Mapping[str, str] | None = None,
    end_of_stream: bool = False,
    subset: object = None,
    protocol: ProtocolConfiguration | None = None,
) -> ProcessingRequest:
    entries = {":method": method, ":path": path, ":authority": "gateway", "content-type": "application/json"}
    header_map = HeaderMap(
        headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in {**entries, **(extra or {})}.items()]
    )
    message = ProcessingRequest(request_headers=HttpHeaders(headers=header_map, end_of_stream=end_of_stream))
    if subset is not None:
        message.metadata_context.CopyFrom(
            metadata({"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": subset}})
        )
    if protocol is not None:
        message.protocol_config.CopyFrom(protocol)
    return message


def response_headers_message(*, status: int | str = 200, served: str | None = None) -> ProcessingRequest:
    """Response headers, with the endpoint that served in ``envoy.lb`` if given."""
    header_map = HeaderMap(headers=[HeaderValue(key=":status", raw_value=str(status).encode())])
    message = ProcessingRequest(response_headers=HttpHeaders(headers=header_map))
    if served is not None:
        served_entry = {"x-gateway-destination-endpoint-served": served}
        message.metadata_context.CopyFrom(metadata({"envoy.lb": served_entry}))
    return message


def metadata(namespaces: Mapping[str, Mapping[str, object]]) -> Metadata:
    result = Metadata()
    for namespace, fields in namespaces.items():
        struct = Struct()
        struct.update(dict(fields))
        result.filter_metadata[namespace].CopyFrom(struct)
    return result


def chat_body(content: str = "hello", *, model: str = MODEL, **fields: Any) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}], **fields}).encode()


class EnvoyStream:
    """One ext_proc stream, as Envoy's filter drives it for one HTTP request."""

    def __init__(self, call: Any, request_mode: int, response_mode: int) -> None:
        self.call = call
        self.protocol = ProtocolConfiguration(
            request_body_mode=request_mode, response_body_mode=response_mode
        )

    async def send(self, message: ProcessingRequest) -> None:
        await self.call.write(message)

    async def read(self) -> ProcessingResponse:
        response = await asyncio.wait_for(self.call.read(), timeout=10)
        assert isinstance(response, ProcessingResponse), f"the stream ended: {response!r}"
        return response

    async def request(
        self, body: bytes, *, path: str = "/v1/chat/completions", chunks: int = 1, **headers: Any
    ) -> list[ProcessingResponse]:
        """Headers then the body (in ``chunks`` pieces); every answer until the choice is made."""
        full_duplex = self.protocol.request_body_mode == FULL_DUPLEX
        await self.send(headers_message(path, protocol=self.protocol, **headers))
        answers = [] if full_duplex else [await self.read()]
        size = -(-len(body) // chunks)
        pieces = [body[start : start + size] for start in range(0, len(body), size)]
        for number, piece in enumerate(pieces, start=1):
            await self.send(
                ProcessingRequest(request_body=HttpBody(body=piece, end_of_stream=number == len(pieces)))
            )
        answers.append(await self.read())
        if full_duplex and answers[-1].HasField("request_headers"):
            while not answers[-1].request_body.response.body_mutation.streamed_response.end_of_stream:
                answers.append(await self.read())
        return answers

    async def response(
        self, *, status: int = 200, served: str | None = None, body_chunks: Sequence[bytes] = (b"{}",)
    ) -> list[ProcessingResponse]:
        """The response's headers (with the served endpoint in ``envoy.lb`` if given) and body chunks."""
        await self.send(response_headers_message(status=status, served=served))
        answers = [await self.read()]
        for number, chunk in enumerate(body_chunks, start=1):
            end = number == len(body_chunks)
            await self.send(ProcessingRequest(response_body=HttpBody(body=chunk, end_of_stream=end)))
            answers.append(await self.read())
        return answers

    async def close(self) -> None:
        await self.call.done_writing()


def destination_of(answer: ProcessingResponse) -> tuple[str, str]:
    """The header and the ``envoy.lb`` metadata values an answer names (they must agree)."""
    common = (
        answer.request_body.response if answer.HasField("request_body") else answer.request_headers.response
    )
    header = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    return header["x-gateway-destination-endpoint"], lb["x-gateway-destination-endpoint"].string_value
