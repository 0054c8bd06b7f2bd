"""herd.api.body: the nesting limit and the Content-Type rule both servers apply to request bodies."""

from __future__ import annotations

import json
from typing import Any

import pytest

from herd.api.body import MAX_JSON_DEPTH, BodyError, check_content_type, json_object


def _nested(depth: int) -> bytes:
    """An object ``depth`` levels deep: the body itself, then alternating arrays and objects."""
    value: Any = 1
    for level in range(depth - 1):
        value = [value] if level % 2 == 0 else {"k": value}
    return json.dumps({"model": "m", "x": value}).encode()


@pytest.mark.parametrize(
    ("raw", "is_refused"),
    [
        (_nested(MAX_JSON_DEPTH), False),
        (_nested(MAX_JSON_DEPTH + 1), True),
        (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", True),
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", True),
        (json.dumps({"prompt": [[1, 2]] * 500, "m": [{"r": "u", "c": "[[[["}] * 100}).encode(), False),
        (json.dumps({"s": "[" * 1000}).encode(), False),
    ],
    ids=[
        "at-the-limit",
        "one-past",
        "past-the-parser-limit",
        "far-past",
        "wide-not-deep",
        "brackets-in-a-string",
    ],
)
def test_json_object_refuses_deep_nesting(raw: bytes, is_refused: bool) -> None:
    if not is_refused:
        assert isinstance(json_object(raw), dict)
        return
    with pytest.raises(BodyError) as caught:
        json_object(raw)
    assert caught.value.status == 400
    assert f"more than {MAX_JSON_DEPTH} levels" in str(caught.value)


@pytest.mark.parametrize(
    ("content_type", "is_accepted"),
    [
        (None, True),
        ("", True),
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("application/vnd.api+json", True),
        ("application/x-www-form-urlencoded", True),
        ("text/plain", False),
        ("multipart/form-data; boundary=x", False),
        ("application/xml", False),
    ],
    ids=["absent", "empty", "json", "json-charset-case", "plus-json", "curl-d", "text", "multipart", "xml"],
)
def test_one_content_type_rule(content_type: str | None, is_accepted: bool) -> None:
    if is_accepted:
        check_content_type(content_type)
        return
    with pytest.raises(BodyError) as caught:
        check_content_type(content_type)
    assert caught.value.status == 415
    assert "send application/json" in str(caught.value)
