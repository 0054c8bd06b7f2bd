"""Reading a JSON request body: a size limit (413) and validation errors that name the field (400)."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from herd.worker.server._errors import ApiError

__all__ = ["read_body"]

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, model: type[M], *, max_bytes: int) -> M:
    """Parse and validate the body as ``model``, or raise ``ApiError`` (400 / 413)."""
    raw = await _read_limited(request, max_bytes)
    try:
        data = json.loads(raw)
    except ValueError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise _invalid(error) from None


async def _read_limited(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {max_bytes} bytes; send a shorter prompt")


def _invalid(error: ValidationError) -> ApiError:
    first = error.errors(include_url=False)[0]
    location = [str(part) for part in first["loc"]]
    param = ".".join(location) or None
    where = f"{param}: " if param else ""
    return ApiError(400, f"invalid request: {where}{first['msg']}", param=param)
