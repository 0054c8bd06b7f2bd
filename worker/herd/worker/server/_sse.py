"""Server-sent events: the ``data:`` framing, admission errors before the headers, errors mid-stream."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TypeVar

from pydantic import BaseModel

from herd.worker.server._errors import as_api_error

__all__ = ["DONE", "event", "primed", "with_error_event"]

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"


async def primed(source: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """Wait for ``source``'s first item now, so that admission errors (429, 400) become the
    response's status instead of an event inside a 200 stream; then yield everything."""
    try:
        first = await anext(source)
    except BaseException:
        await source.aclose()
        raise
    return _chain(first, source)


async def _chain(first: T, rest: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item


async def with_error_event(events: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """Pass ``events`` through; a failure becomes one ``data: {"error": ...}`` event that ends the stream."""
    async with aclosing(events):
        try:
            async for item in events:
                yield item
        except Exception as error:  # as_api_error logs what no one logged yet
            yield event(as_api_error(error).envelope())
