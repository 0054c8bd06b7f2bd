"""The internal port: what the orchestrator and peer workers read, behind the shared token."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import StreamingResponse

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
from herd.worker.engine_protocol import ServingEngine
from herd.worker.server._errors import install_error_handlers

__all__ = ["MAX_KV_EVENTS_WAIT_S", "build_internal_app", "require_token"]

MAX_KV_EVENTS_WAIT_S = 10.0


def require_token(request: Request, token: str) -> None:
    """Raise 401 unless ``request`` carries the worker's internal ``token`` in ``TOKEN_HEADER``."""
    given = request.headers.get(TOKEN_HEADER, "")
    if not secrets.compare_digest(given.encode(), token.encode()):
        raise HttpError(401, f"missing or wrong {TOKEN_HEADER} header; send the worker's internal token")


def build_internal_app(engine: ServingEngine, token: str, routers: Sequence[APIRouter] = ()) -> FastAPI:
    """The internal API; ``routers`` add more endpoints (disaggregation) under the same token check."""

    async def check_token(request: Request) -> None:
        require_token(request, token)

    app = FastAPI(
        title="herd worker (internal)",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        dependencies=[Depends(check_token)],
    )
    install_error_handlers(app)
    app.include_router(_engine_router(engine))
    for router in routers:
        app.include_router(router)
    return app


def _engine_router(engine: ServingEngine) -> APIRouter:
    router = APIRouter()

    @router.get(INTERNAL_PATHS.info)
    async def info() -> WorkerInfo:
        return engine.info

    @router.get(INTERNAL_PATHS.load)
    async def load() -> LoadReport:
        return engine.load_report()

    @router.get(INTERNAL_PATHS.kv_events)
    async def kv_events(
        after: Annotated[int, Query(description="Return events with a larger seq.")] = -1,
        wait: Annotated[
            float, Query(ge=0.0, le=MAX_KV_EVENTS_WAIT_S, description="Long-poll seconds.")
        ] = 0.0,
    ) -> KVEventBatch:
        events = await engine.kv_events_after(after, wait=wait)
        return KVEventBatch(epoch=engine.info.epoch, events=events)

    @router.get(INTERNAL_PATHS.kv_snapshot)
    async def kv_snapshot() -> KVSnapshot:
        return await engine.kv_snapshot()

    @router.get(INTERNAL_PATHS.status)
    async def status(query: Annotated[StatusQuery, Query()]) -> StreamingResponse:
        """Readiness, load and KV events as they change (``herd.api.protocol.WorkerStatus``)."""
        engine.info  # noqa: B018 -- raises (503) while the model loads: no stream before an epoch
        return StreamingResponse(
            status_lines(_status_source(engine), query), media_type="application/x-ndjson"
        )

    @router.get(INTERNAL_PATHS.tokenizer)
    async def tokenizer() -> TokenizerFiles:
        """What the orchestrator tokenizes with when it has no copy of the model folder."""
        return TokenizerFiles(files=dict(engine.renderer.files))

    return router


def _status_source(engine: ServingEngine) -> StatusSource:
    async def probe() -> tuple[bool, LoadReport]:
        return engine.is_ready, engine.load_report()

    async def events_after(seq: int, wait: float) -> list[KVEvent]:
        return await engine.kv_events_after(seq, wait=wait)

    return StatusSource(lambda: engine.info.epoch, probe, events_after, engine.kv_snapshot)
