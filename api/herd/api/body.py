"""Request bodies as the gateway and the worker read them, so both refuse the same bodies with the
same words: a size limit checked against ``Content-Length`` before reading and against the bytes
while reading (a chunked body has no length), one rule for the ``Content-Type``, and the rule that
an API body is one JSON object nested at most ``MAX_JSON_DEPTH`` levels deep (and so is JSON text
a body carries in a string: ``json_value``).

Each server turns ``BodyError`` into its own error envelope with ``status``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "BodyError", "check_content_type", "json_object", "json_value", "read_limited"]

MAX_JSON_DEPTH = 64
"""Levels of arrays and objects a body may nest. An OpenAI request nests a few (a JSON schema in
``tools`` or ``response_format`` perhaps a dozen); a deeper one only makes every later step that
walks it (validation, re-serialising it to a worker) recurse without bound."""

_SHORT_BODY_BYTES = 2048
_SCALARS = frozenset({str, int, float, bool, type(None)})
_FORM = "application/x-www-form-urlencoded"
"""What ``curl -d`` declares unless told otherwise; the body is still the client's JSON."""


class BodyError(ValueError):
    """A refused body: ``status`` 413 when too large, 415 for a media type that is not JSON, 400
    when it is not a JSON object (or nests too deep)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def check_content_type(content_type: str | None) -> None:
    """Raise ``BodyError(415)`` unless ``content_type`` is absent, JSON (``application/json`` or any
    ``*/*+json``) or ``application/x-www-form-urlencoded`` (``curl -d``'s default)."""
    if not content_type:
        return
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type in ("application/json", _FORM) or media_type.endswith("+json"):
        return
    raise BodyError(415, f"the request body's Content-Type {media_type!r} is not JSON; send application/json")


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
    """``raw`` parsed, or ``BodyError(400)`` when it is not valid JSON, not an object, or too deep."""
    payload = json_value(raw, what="the request body")
    if not isinstance(payload, dict):
        raise BodyError(400, "the request body must be a JSON object")
    return payload


def json_value(text: str | bytes, *, what: str) -> Any:
    """JSON ``text`` from a client (a body, a JSON string inside one, a model's output) parsed, or
    ``BodyError(400)`` saying that ``what`` is not valid JSON or nests more than ``MAX_JSON_DEPTH``
    levels: parsing it must neither recurse past Python's limit nor hand on a value every later walk
    of which would."""
    try:
        value = json.loads(text)
    except RecursionError:  # past Python's own limit (~1,000 levels): the parser gives up
        raise _too_deep(what) from None
    except ValueError as error:
        raise BodyError(400, f"{what} is not valid JSON: {error}") from None
    if isinstance(value, dict | list) and not _is_shallow(text) and _nests_deeper(value, MAX_JSON_DEPTH):
        raise _too_deep(what)
    return value


def _is_shallow(text: str | bytes) -> bool:
    """A short text with few brackets cannot nest deep: two counts decide most requests at once
    (on a long one the counts would cost more than the walk over its parsed containers)."""
    if len(text) > _SHORT_BODY_BYTES:
        return False
    if isinstance(text, str):
        return text.count("[") + text.count("{") <= MAX_JSON_DEPTH
    return text.count(b"[") + text.count(b"{") <= MAX_JSON_DEPTH


def _nests_deeper(payload: dict[str, Any] | list[Any], limit: int) -> bool:
    """Whether ``payload`` has more than ``limit`` levels, walked level by level over containers only.

    A container of scalars alone (a long prompt string, a list of token ids) is passed over in one C
    loop (``issuperset`` over the item types), so the walk costs little beside ``json.loads``.
    """
    level: list[dict[str, Any] | list[Any]] = [payload]
    for _ in range(limit):
        below: list[dict[str, Any] | list[Any]] = []
        for container in level:
            items = container.values() if isinstance(container, dict) else container
            if not _SCALARS.issuperset(map(type, items)):
                below.extend(item for item in items if isinstance(item, dict | list))
        if not below:
            return False
        level = below
    return True


def _too_deep(what: str) -> BodyError:
    return BodyError(
        400, f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; flatten it"
    )


def _too_large(max_bytes: int) -> BodyError:
    return BodyError(413, f"the request body is larger than {max_bytes} bytes; send a shorter prompt")
