"""The ``/v1/files`` and ``/v1/batches`` routes, each request acting for its tenant only."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from herd.api.errors import HttpError, invalid_request
from herd.orchestrator.auth import tenant_of
from herd.orchestrator.batch.lines import BATCH_ENDPOINTS
from herd.orchestrator.batch.runner import BatchRunner
from herd.orchestrator.batch.store import BatchRecord, BatchStore, FileRecord

__all__ = ["add_batch_routes"]

COMPLETION_WINDOWS = {"24h": 24 * 3600}
"""OpenAI's one window; a batch still running at its end expires."""
_PURPOSES = ("batch",)


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)


def add_batch_routes(
    app: FastAPI,
    store: BatchStore,
    runner: BatchRunner,
    *,
    max_file_bytes: int,
    read_body: Callable[[Request], Awaitable[bytes]],
) -> None:
    """``read_body``: the gateway's reader of a JSON body (its media type, size and time limits)."""
    _add_file_routes(app, store, max_file_bytes)

    async def create(request: Request) -> Response:
        tenant = tenant_of(request.scope)
        try:
            wanted = CreateBatch.model_validate_json(await read_body(request))
        except ValidationError as error:
            raise invalid_request(error.errors(include_url=False)) from None
        _check(wanted)
        source = store.file(wanted.input_file_id, tenant)
        if source.purpose != "batch":
            raise HttpError(
                400,
                f"file {source.id!r} has purpose {source.purpose!r}; upload it with purpose 'batch'",
                param="input_file_id",
            )
        now = int(time.time())
        record = BatchRecord(
            tenant=tenant,
            id=f"batch_{source.id.removeprefix('file-')}_{now}",
            endpoint=wanted.endpoint,
            input_file_id=source.id,
            completion_window=wanted.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + COMPLETION_WINDOWS[wanted.completion_window],
            metadata=wanted.metadata,
        )
        store.save_batch(record)
        runner.start(record)
        return JSONResponse(record.public())

    async def retrieve(request: Request, batch_id: str) -> Response:
        return JSONResponse(store.batch(batch_id, tenant_of(request.scope)).public())

    async def cancel(request: Request, batch_id: str) -> Response:
        return JSONResponse(runner.cancel(store.batch(batch_id, tenant_of(request.scope))).public())

    async def listed(request: Request, after: str | None = None, limit: int = 20) -> Response:
        records = store.batches(tenant_of(request.scope))
        return JSONResponse(_page([record.public() for record in records], after, limit))

    app.add_api_route("/v1/batches", create, methods=["POST"], include_in_schema=False)
    app.add_api_route("/v1/batches", listed, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/batches/{batch_id}", retrieve, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/batches/{batch_id}/cancel", cancel, methods=["POST"], include_in_schema=False)


def _check(wanted: CreateBatch) -> None:
    if wanted.endpoint not in BATCH_ENDPOINTS:
        raise HttpError(400, f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}", param="endpoint")
    if wanted.completion_window not in COMPLETION_WINDOWS:
        raise HttpError(400, "completion_window must be '24h'", param="completion_window")


def _add_file_routes(app: FastAPI, store: BatchStore, max_file_bytes: int) -> None:
    async def upload(
        request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
    ) -> Response:
        if purpose not in _PURPOSES:
            raise HttpError(400, f"purpose must be one of {', '.join(_PURPOSES)}", param="purpose")
        content = await file.read(max_file_bytes + 1)
        if len(content) > max_file_bytes:
            raise HttpError(413, f"the file exceeds {max_file_bytes} bytes; split the batch", param="file")
        record = store.add_file(tenant_of(request.scope), file.filename or "upload.jsonl", purpose, content)
        return JSONResponse(record.public())

    async def retrieve(request: Request, file_id: str) -> Response:
        return JSONResponse(store.file(file_id, tenant_of(request.scope)).public())

    async def content(request: Request, file_id: str) -> Response:
        record: FileRecord = store.file(file_id, tenant_of(request.scope))
        return Response(store.content(record), media_type="application/jsonl")

    async def delete(request: Request, file_id: str) -> Response:
        record = store.file(file_id, tenant_of(request.scope))
        store.delete_file(record)
        return JSONResponse({"id": record.id, "object": "file", "deleted": True})

    async def listed(
        request: Request, purpose: str | None = None, after: str | None = None, limit: int = 10000
    ) -> Response:
        records = store.files(tenant_of(request.scope), purpose)
        return JSONResponse(_page([record.public() for record in records], after, limit))

    app.add_api_route("/v1/files", upload, methods=["POST"], include_in_schema=False)
    app.add_api_route("/v1/files", listed, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/files/{file_id}", retrieve, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/files/{file_id}", delete, methods=["DELETE"], include_in_schema=False)
    app.add_api_route("/v1/files/{file_id}/content", content, methods=["GET"], include_in_schema=False)


def _page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: the items after the one named ``after``, at most ``limit``."""
    if not 1 <= limit <= 10000:
        raise HttpError(400, "limit must lie in [1, 10000]", param="limit")
    start = next((index + 1 for index, item in enumerate(items) if item["id"] == after), 0) if after else 0
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    }
