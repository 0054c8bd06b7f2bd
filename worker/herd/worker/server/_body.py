"""Reading a JSON request body: its media type (415), a size limit (413), and validation errors that
name the field (400)."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from herd.api.body import BodyError, check_content_type, json_object, read_limited
from herd.api.errors import HttpError, invalid_request
from herd.api.prompt import PromptThreads

__all__ = ["read_body"]

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, model: type[M], *, max_bytes: int, threads: PromptThreads) -> M:
    """Parse and validate the body as ``model``, or raise ``HttpError`` (400 / 413 / 415); a large one
    on ``threads`` (a multi-MB body takes tens of milliseconds to parse)."""
    declared = request.headers.get("content-length")
    try:
        check_content_type(request.headers.get("content-type"))
        raw = await read_limited(request.stream(), max_bytes, declared_length=declared)
    except BodyError as error:
        raise HttpError(error.status, str(error)) from None
    return await threads.run_sized(len(raw), _parse, raw, model)


def _parse(raw: bytes, model: type[M]) -> M:
    try:
        return model.model_validate(json_object(raw))
    except BodyError as error:
        raise HttpError(error.status, str(error)) from None
    except ValidationError as error:
        raise invalid_request(error.errors(include_url=False)) from None
