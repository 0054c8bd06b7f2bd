"""The internal port: herd's worker contract (info, load, KV events and snapshot, tokenizer) for a
vLLM server, behind the shared token, as a herd worker serves it."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse

from herd.api.errors import HttpError
from herd.api.protocol import (
    INTERNAL_PATHS,
    TOKEN_HEADER,
    KVEventBatch,
    KVSnapshot,
    LoadReport,
    TokenizerFiles,
    WorkerInfo,
)
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
) -> FastAPI:
    """``info`` and ``load`` raise ``HttpError`` (503) until vLLM is up."""

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

    @app.get(INTERNAL_PATHS.tokenizer)
    async def get_tokenizer() -> TokenizerFiles:
        return tokenizer

    return app
