"""Request bodies as the gateway and the worker read them, so both refuse the same bodies with the
same words: a size limit checked against ``Content-Length`` before reading and against the bytes
while reading (a chunked body has no length), and the rule that an API body is one JSON object.

Each server turns ``BodyError`` into its own error envelope with ``status``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable
from typing import Any

__all__ = ["BodyError", "json_object", "read_limited"]


class BodyError(ValueError):
    """A refused body: ``status`` 413 when it is too large, 400 when it is not a JSON object."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_limited(chunks: AsyncIterable[bytes], max_bytes: int, *, declared_length: str | None) -> bytes:
    """The whole body, or ``BodyError(413)`` as soon as it (or its declared length) passes ``max_bytes``."""
    if declared_length is not None and declared_length.isdigit() and int(declared_length) > max_bytes:
        raise _too_large(max_bytes)
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        parts.append(chunk)
    return b"".join(parts)


def json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` parsed, or ``BodyError(400)`` when it is not valid JSON or not an object."""
    try:
        payload = json.loads(raw)
    except ValueError as error:
        raise BodyError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise BodyError(400, "the request body must be a JSON object")
    return payload


def _too_large(max_bytes: int) -> BodyError:
    return BodyError(413, f"the request body is larger than {max_bytes} bytes; send a shorter prompt")
