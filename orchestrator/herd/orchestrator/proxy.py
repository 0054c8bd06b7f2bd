"""The streaming proxy's client side: relay a worker's open answer to the client as it arrives.

``RelayResponse`` writes each chunk the moment it arrives (no buffering), watches the client for a
disconnect and, on one, closes the upstream answer so the worker aborts the request. A worker
failing mid-stream ends the client's stream with an SSE error event rather than leaving it hanging,
unless the stream is resumable (``Resumer``): its events then pass through a ``StreamLedger`` (whole
token runs at a time, ``herd.orchestrator.resume``) and a failed worker's stream goes on from
another worker's answer, in the same response.
The upstream answer is always closed, shielded from cancellation, and ``on_done`` always runs, told
how the stream ended (``StreamEnd``).
Opening the answer (and retrying before its first byte) is ``herd.orchestrator.upstream``'s job.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Literal, Protocol

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from herd.api.openai import ErrorResponse
from herd.orchestrator.resume import StreamLedger
from herd.orchestrator.upstream import Upstream, UpstreamError

__all__ = ["RelayResponse", "Resumer", "StreamEnd", "build_http_client", "sse_error"]

log = logging.getLogger(__name__)

StreamEnd = Literal["complete", "worker_failed", "client_left"]


def build_http_client(*, max_connections: int = 1024, connect_timeout: float = 2.0) -> httpx.AsyncClient:
    """The client the orchestrator's other calls share (polling, prefill, tokenizer fetch): pooled, bounded."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0, connect=connect_timeout))


def sse_error(message: str, status: int = 502) -> bytes:
    """An SSE event carrying the OpenAI error envelope (the openai SDK raises it as an APIError)."""
    return b"data: " + json.dumps(ErrorResponse.of(status, message).model_dump()).encode() + b"\n\n"


class Resumer(Protocol):
    """Continues a resumable stream on another worker (the gateway's side of ``herd.api.resume``)."""

    ledger: StreamLedger

    async def resume(self, error: UpstreamError) -> Upstream | None:
        """Another worker's answer going on from ``ledger``'s point, or None when there is none."""
        ...


class RelayResponse(Response):
    """Relays an ``Upstream`` to the client chunk by chunk; see the module docstring for guarantees."""

    def __init__(
        self,
        upstream: Upstream,
        *,
        headers: Mapping[str, str],
        on_done: Callable[[StreamEnd], None],
        on_chunk: Callable[[bytes], None] | None = None,
        resumer: Resumer | None = None,
    ) -> None:
        # Like StreamingResponse, no super().__init__: it would announce a zero content-length.
        self.status_code = upstream.status_code
        self.background = None
        self.init_headers({**upstream.headers_for_client(), **headers})
        self.upstream = upstream
        self.on_done = on_done
        self.on_chunk = on_chunk
        """Sees every chunk as it is sent (the gateway counts a stream's tokens with it)."""
        self.resumer = resumer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ending: StreamEnd = "client_left"  # unless the relay returns: the client went away
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._cancel_on_disconnect, receive, group.cancel_scope)
                await send(
                    {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
                )
                ending = await self._relay(send)
                group.cancel_scope.cancel()
        finally:
            await self.upstream.aclose()
            self.on_done(ending)

    async def _relay(self, send: Send) -> StreamEnd:
        """Send every chunk; ``worker_failed`` when the worker failed mid-stream and no other worker
        took the stream over (the client got an error event)."""
        ending: StreamEnd = "complete"
        while True:
            try:
                await self._relay_one(send)
                break
            except UpstreamError as error:
                log.warning("upstream failed mid-stream", extra={"error": f"{type(error).__name__}: {error}"})
                resumed = None if self.resumer is None else await self.resumer.resume(error)
                if resumed is None:
                    message = "the worker failed mid-response; retry the request"
                    await send({"type": "http.response.body", "body": sse_error(message), "more_body": True})
                    ending = "worker_failed"
                    break
                await self.upstream.aclose()
                self.upstream = resumed
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return ending

    async def _relay_one(self, send: Send) -> None:
        """Send ``upstream``'s chunks, through the resumer's ledger when there is one."""
        ledger = None if self.resumer is None else self.resumer.ledger
        observe = self.on_chunk
        chunk = self.upstream.first_chunk
        while chunk:
            if ledger is not None:
                chunk = ledger.feed(chunk)
            if chunk:
                if observe is not None:
                    observe(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            chunk = await self.upstream.body.next_chunk()
        if ledger is not None and (rest := ledger.flush()):
            if observe is not None:
                observe(rest)
            await send({"type": "http.response.body", "body": rest, "more_body": True})

    @staticmethod
    async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()
