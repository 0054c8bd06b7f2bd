"""herd.api.body: the size limit and the JSON-object rule both servers apply to request bodies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from herd.api.body import MAX_JSON_DEPTH, BodyError, json_object, json_value, read_limited


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


async def _chunks(parts: list[bytes], read: list[int]) -> AsyncIterator[bytes]:
    for part in parts:
        read.append(len(part))
        yield part


@pytest.mark.parametrize(
    ("parts", "declared", "status", "num_read"),
    [
        ([b'{"a":', b" 1}"], None, None, 2),
        ([b"x" * 10], "10", None, 1),
        ([b"x" * 6, b"x" * 6, b"x" * 6], None, 413, 2),  # stops at the chunk that passes the limit
        ([b"x" * 5], "11", 413, 0),  # a declared length over the limit refuses before reading
        ([b"x" * 5], "abc", None, 1),  # a malformed header is left to the byte count
    ],
    ids=["fits", "exactly-the-limit", "chunked-too-large", "declared-too-large", "bad-header"],
)
def test_read_limited(parts: list[bytes], declared: str | None, status: int | None, num_read: int) -> None:
    read: list[int] = []

    async def run() -> bytes:
        return await read_limited(_chunks(parts, read), 10, declared_length=declared)

    if status is None:
        assert asyncio.run(run()) == b"".join(parts)
    else:
        with pytest.raises(BodyError, match="larger than 10 bytes") as raised:
            asyncio.run(run())
        assert raised.value.status == status
    assert len(read) == num_read


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(b'{"model": "m"}', {"model": "m"}), (b"{}", {})],
    ids=["object", "empty-object"],
)
def test_json_object_accepts_an_object(raw: bytes, expected: dict[str, Any]) -> None:
    assert json_object(raw) == expected


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
    ],
    ids=["malformed", "empty", "array", "string"],
)
def test_json_object_refuses_anything_else(raw: bytes, message: str) -> None:
    with pytest.raises(BodyError, match=message) as raised:
        json_object(raw)
    assert raised.value.status == 400


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": [1, 2]}', {"a": [1, 2]}),
        (b"[[1]]", [[1]]),
        ('"a string"', "a string"),
        ("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, _nested(MAX_JSON_DEPTH)),
    ],
    ids=["object", "bytes", "scalar", "at-the-limit"],
)
def test_json_value_parses_json_text_a_body_carries(text: str | bytes, expected: object) -> None:
    assert json_value(text, what="the arguments") == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "the arguments is not valid JSON"),
        ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "more than 64 levels"),
        ("[" * 5000 + "]" * 5000, "more than 64 levels"),  # past Python's recursion limit
        ('{"a": ' * 3000 + "1" + "}" * 3000, "more than 64 levels"),
        (b"[" * 5000 + b"]" * 5000, "more than 64 levels"),
    ],
    ids=["malformed", "one-past-the-limit", "recursion-deep-array", "recursion-deep-object", "bytes"],
)
def test_json_value_refuses_what_is_not_json_or_too_deep(text: str | bytes, message: str) -> None:
    with pytest.raises(BodyError, match=message) as raised:
        json_value(text, what="the arguments")
    assert raised.value.status == 400
