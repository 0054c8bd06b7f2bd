"""The internal port: herd's worker contract (info, load, KV events and snapshot, tokenizer) for a
vLLM server, behind the shared token, as a herd worker serves it."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from herd.api.errors import HttpError
from herd.api.protocol import (
    INTERNAL_PATHS,
    TOKEN_HEADER,
    KVEvent,
    KVEventBatch,
    KVSnapshot,
    LoadReport,
    StatusQuery,
    TokenizerFiles,
    WorkerInfo,
)
from herd.api.worker_status import StatusSource, status_lines
from herd.sidecar._kv_state import KVState
from herd.sidecar._proxy import error_response

__all__ = ["MAX_KV_EVENTS_WAIT_S", "build_internal_app"]

MAX_KV_EVENTS_WAIT_S = 10.0


def build_internal_app(
    token: str,
    kv: KVState,
    info: Callable[[], WorkerInfo],
    load: Callable[[], Awaitable[LoadReport]],
    tokenizer: TokenizerFiles,
    is_ready: Callable[[], bool],
) -> FastAPI:
    """``info`` and ``load`` raise ``HttpError`` (503) until vLLM is up; ``is_ready`` is the sidecar's
    own half of ``/ready`` (vLLM learned, not draining), the status stream's other half being that
    vLLM's metrics answer."""

    async def check_token(request: Request) -> None:
        given = request.headers.get(TOKEN_HEADER, "")
        if not secrets.compare_digest(given.encode(), token.encode()):
            raise HttpError(401, f"missing or wrong {TOKEN_HEADER} header; send the worker's internal token")

    app = FastAPI(title="herd vLLM sidecar (internal)", openapi_url=None, dependencies=[Depends(check_token)])

    async def on_error(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, HttpError)
        return error_response(error)

    app.add_exception_handler(HttpError, on_error)

    @app.get(INTERNAL_PATHS.info)
    async def get_info() -> WorkerInfo:
        return info()

    @app.get(INTERNAL_PATHS.load)
    async def get_load() -> LoadReport:
        return await load()

    @app.get(INTERNAL_PATHS.kv_events)
    async def kv_events(
        after: Annotated[int, Query(description="Return events with a larger seq.")] = -1,
        wait: Annotated[
            float, Query(ge=0.0, le=MAX_KV_EVENTS_WAIT_S, description="Long-poll seconds.")
        ] = 0.0,
    ) -> KVEventBatch:
        events = await kv.feed.after(after, wait=wait)
        return KVEventBatch(epoch=kv.epoch, events=events)

    @app.get(INTERNAL_PATHS.kv_snapshot)
    async def kv_snapshot() -> KVSnapshot:
        return kv.snapshot()

    @app.get(INTERNAL_PATHS.status)
    async def status(query: Annotated[StatusQuery, Query()]) -> StreamingResponse:
        """Readiness, load and KV events as they change (``herd.api.protocol.WorkerStatus``)."""
        await load()  # a 503 until vLLM is up: no stream before the worker can say its load
        source = _status_source(kv, load, is_ready)
        return StreamingResponse(status_lines(source, query), media_type="application/x-ndjson")

    @app.get(INTERNAL_PATHS.tokenizer)
    async def get_tokenizer() -> TokenizerFiles:
        return tokenizer

    return app


def _status_source(
    kv: KVState, load: Callable[[], Awaitable[LoadReport]], is_ready: Callable[[], bool]
) -> StatusSource:
    last = LoadReport()

    async def probe() -> tuple[bool, LoadReport]:
        nonlocal last
        try:
            last = await load()
        except HttpError:  # vLLM's metrics did not answer or were unreadable: not ready
            return False, last
        return is_ready(), last

    async def events_after(seq: int, wait: float) -> list[KVEvent]:
        return await kv.feed.after(seq, wait=wait)

    async def snapshot() -> KVSnapshot:
        return kv.snapshot()

    return StatusSource(lambda: kv.epoch, probe, events_after, snapshot)
