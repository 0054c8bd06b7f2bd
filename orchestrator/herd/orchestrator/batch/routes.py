"""The ``/v1/files`` and ``/v1/batches`` routes, each request acting for its tenant only."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import FormData, UploadFile

from herd.api.errors import HttpError, invalid_request
from herd.orchestrator.auth import tenant_of
from herd.orchestrator.batch.lines import BATCH_ENDPOINTS
from herd.orchestrator.batch.runner import BatchRunner
from herd.orchestrator.batch.store import BatchRecord, BatchStore, FileRecord

__all__ = ["add_batch_routes"]

COMPLETION_WINDOWS = {"24h": 24 * 3600}
"""OpenAI's one window; a batch still running at its end expires."""
_PURPOSES = ("batch",)
MULTIPART_SLACK_BYTES = 64 * 1024
"""What an upload's body may hold beyond the file: the multipart framing and the other fields."""
_FORM_FIELDS = 3
"""Fields besides the file: ``purpose``, and OpenAI's ``expires_after[anchor]`` and
``expires_after[seconds]``, which SDKs may send (files here are kept until deleted)."""
ReadForm = Callable[[Request, int, int], Awaitable[FormData]]
"""The gateway's reader of a multipart body: ``(request, max_bytes, max_fields)``, with its time limit."""


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = (
        Field(default=None, max_length=16)
    )
    """OpenAI's limits: 16 pairs, keys of 64 characters, values of 512."""


def add_batch_routes(
    app: FastAPI,
    store: BatchStore,
    runner: BatchRunner,
    *,
    max_file_bytes: int,
    read_body: Callable[[Request], Awaitable[bytes]],
    read_form: ReadForm,
) -> None:
    """``read_body``: the gateway's reader of a JSON body (its media type, size and time limits);
    ``read_form``: of a multipart one (an upload)."""
    _add_file_routes(app, store, max_file_bytes, read_form)

    async def create(request: Request) -> Response:
        tenant = tenant_of(request.scope).name
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
            id=f"batch_{secrets.token_hex(12)}",
            endpoint=wanted.endpoint,
            input_file_id=source.id,
            completion_window=wanted.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + COMPLETION_WINDOWS[wanted.completion_window],
            metadata=wanted.metadata,
        )
        store.add_batch(record)
        runner.start(record)
        return JSONResponse(record.public())

    async def retrieve(request: Request, batch_id: str) -> Response:
        return JSONResponse(store.batch(batch_id, tenant_of(request.scope).name).public())

    async def cancel(request: Request, batch_id: str) -> Response:
        return JSONResponse(runner.cancel(store.batch(batch_id, tenant_of(request.scope).name)).public())

    async def listed(request: Request, after: str | None = None, limit: int = 20) -> Response:
        records = store.batches(tenant_of(request.scope).name)
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


def _add_file_routes(app: FastAPI, store: BatchStore, max_file_bytes: int, read_form: ReadForm) -> None:
    async def upload(request: Request) -> Response:
        form = await read_form(request, max_file_bytes + MULTIPART_SLACK_BYTES, _FORM_FIELDS)
        try:
            purpose, file = form.get("purpose"), form.get("file")
            if purpose not in _PURPOSES:
                raise HttpError(400, f"purpose must be one of {', '.join(_PURPOSES)}", param="purpose")
            if not isinstance(file, UploadFile):
                raise HttpError(400, "send the file as the multipart part named 'file'", param="file")
            content = await file.read(max_file_bytes + 1)
            if len(content) > max_file_bytes:
                raise HttpError(
                    413, f"the file exceeds {max_file_bytes} bytes; split the batch", param="file"
                )
            tenant, filename = tenant_of(request.scope).name, file.filename or "upload.jsonl"
            # Up to max_file_bytes written and fsync'd: in a thread, not holding up the event loop.
            record = await asyncio.to_thread(store.add_file, tenant, filename, str(purpose), content)
        finally:
            await form.close()
        return JSONResponse(record.public())

    async def retrieve(request: Request, file_id: str) -> Response:
        return JSONResponse(store.file(file_id, tenant_of(request.scope).name).public())

    async def content(request: Request, file_id: str) -> Response:
        record: FileRecord = store.file(file_id, tenant_of(request.scope).name)
        return Response(await asyncio.to_thread(store.content, record), media_type="application/jsonl")

    async def delete(request: Request, file_id: str) -> Response:
        record = store.file(file_id, tenant_of(request.scope).name)
        using = store.unfinished_batch_using(record)
        if using is not None:
            raise HttpError(
                409,
                f"batch {using.id!r} ({using.status}) uses file {record.id!r}; delete it once the batch "
                "has finished, or cancel the batch first",
                param="file_id",
            )
        store.delete_file(record)
        return JSONResponse({"id": record.id, "object": "file", "deleted": True})

    async def listed(
        request: Request, purpose: str | None = None, after: str | None = None, limit: int = 10000
    ) -> Response:
        records = store.files(tenant_of(request.scope).name, purpose)
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
    start = 0
    if after:
        start = next((index + 1 for index, item in enumerate(items) if item["id"] == after), -1)
        if start < 0:
            raise HttpError(
                400, f"after: no item {after!r} in this list; pass the last_id of a page", param="after"
            )
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    }
