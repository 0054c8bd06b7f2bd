"""How every herd server answers an error: the OpenAI envelope, one sentence, the field to change.

``HttpError`` is what request handling raises in the gateway and the worker alike (each turns it
into its framework's response with ``envelope()``); ``invalid_request`` turns pydantic's validation
errors into one sentence naming the field, never a dump; ``route_message`` says what to do about a
routing error (404: no such route, 405: another method).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from herd.api.openai import ErrorResponse

__all__ = ["HttpError", "enveloped", "invalid_request", "route_message"]

_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})
"""Pydantic names the member of a union in an error's location; a client's field path has no such part."""


class HttpError(Exception):
    """A request failure with its HTTP status, the offending field and extra headers."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def envelope(self) -> ErrorResponse:
        return ErrorResponse.of(self.status, self.message, param=self.param)


def invalid_request(
    errors: Sequence[Mapping[str, Any]], *, within: str | None = None, status: int = 400
) -> HttpError:
    """The first of pydantic's ``errors`` as one sentence; its field path is ``param``.

    ``within`` names the request field whose value was validated (``kv_transfer_params``). A value
    that fits none of a union's forms is described by the forms, not by the first form's complaint.
    """
    first = errors[0]
    location = list(first["loc"])
    num_parts = next((i for i, part in enumerate(location) if not _is_field(part)), len(location))
    names = [str(part) for part in location[:num_parts]]
    param = ".".join([within, *names] if within else names) or None
    if param is None:
        return HttpError(status, f"invalid request: {_detail(first)}")
    if first["type"] == "missing":
        return HttpError(status, f"invalid request: `{param}` is required", param=param)
    is_union = num_parts < len(location)
    expected = _union_forms(errors, location[:num_parts]) if is_union else _detail(first)
    return HttpError(status, f"invalid request: `{param}`: {expected}{_given(first)}", param=param)


def enveloped(content: bytes, status: int, describe: Callable[[Any], str]) -> bytes:
    """An upstream's error answer as is when it is an OpenAI error envelope, else wrapped in one whose
    message ``describe`` makes of the parsed body (its text when it is not JSON)."""
    try:
        body = json.loads(content)
    except ValueError:
        body = content.decode(errors="replace")
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return content
    return json.dumps(ErrorResponse.of(status, describe(body)).model_dump()).encode()


def route_message(method: str, path: str, status: int, *, allow: str | None, detail: str) -> str:
    """Starlette's routing errors ("Not Found", "Method Not Allowed") as sentences that say what to do."""
    if status == 404:
        return f"there is no route {method} {path}; GET /openapi.json lists the routes"
    if status == 405:
        return f"{method} is not allowed on {path}; use {allow or 'another method'}"
    return detail


def _union_forms(errors: Sequence[Mapping[str, Any]], field: list[Any]) -> str:
    """The forms a union field takes, from the tags pydantic put after ``field`` in its errors."""
    depth = len(field)
    forms = dict.fromkeys(
        str(error["loc"][depth])
        for error in errors
        if list(error["loc"][:depth]) == field and len(error["loc"]) > depth
    )
    return f"expected one of {', '.join(forms)}"


def _detail(error: Mapping[str, Any]) -> str:
    detail = str(error["msg"]).removeprefix("Value error, ")
    return detail[:1].lower() + detail[1:]


def _given(error: Mapping[str, Any]) -> str:
    value = error.get("input")
    return "" if isinstance(value, dict | list) else f" (got {value!r:.60})"


def _is_field(part: int | str) -> bool:
    return isinstance(part, int) or not (part in _UNION_TAGS or "[" in part or "(" in part)
