"""Reading a JSON request body: its media type (415), a size limit (413), and validation errors that
name the field (400)."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from herd.api.body import BodyError, check_content_type, json_object, read_limited
from herd.api.errors import HttpError, invalid_request

__all__ = ["read_body"]

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, model: type[M], *, max_bytes: int) -> M:
    """Parse and validate the body as ``model``, or raise ``HttpError`` (400 / 413 / 415)."""
    declared = request.headers.get("content-length")
    try:
        check_content_type(request.headers.get("content-type"))
        data = json_object(await read_limited(request.stream(), max_bytes, declared_length=declared))
    except BodyError as error:
        raise HttpError(error.status, str(error)) from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise invalid_request(error.errors(include_url=False)) from None
