"""Parsing a chat choice's text into content and tool calls, whole and streamed (issue 15)."""

from __future__ import annotations

import json

import pytest

from herd.api.openai import ToolCallDelta
from herd.worker.server._tool_calls import Event, ToolCallParser, ToolMode

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
DEEP = "[" * 1100 + "]" * 1100
"""What a model may write (or a grammar force it to): deeper than Python's JSON parser recurses."""


def _run(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[str, dict[str, object]]]]:
    """Feed ``pieces`` one by one and close: the content and the (name, arguments) of each call."""
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.close()
    content = "".join(event for event in events if isinstance(event, str))
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ToolCallDelta):
            entry = calls.setdefault(event.index, [event.function.name or "", ""])
            entry[1] += event.function.arguments or ""
    return content, [(name, json.loads(arguments)) for name, arguments in calls.values()]


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 1000], ids=["by-char", "by-3", "whole"])
@pytest.mark.parametrize(
    ("mode", "fmt", "text", "content", "calls"),
    [
        ("none", "hermes", f"<tool_call>{WEATHER}</tool_call>", f"<tool_call>{WEATHER}</tool_call>", []),
        ("auto", "hermes", "Paris is sunny.", "Paris is sunny.", []),
        ("auto", "hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", {"city": "Paris"})]),
        (
            "auto",
            "hermes",
            f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{WEATHER}</tool_call>",
            "Let me look.\n\n",
            [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Paris"})],
        ),
        ("auto", "hermes", "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
        ("auto", "hermes", "a < b <tool", "a < b <tool", []),
        ("auto", "hermes", f"<tool_call>\n{WEATHER}", "", [("get_weather", {"city": "Paris"})]),
        ("auto", "json", '{"name": "f", "parameters": {"x": 1}}', "", [("f", {"x": 1})]),
        (
            "auto",
            "json",
            '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"y": 2}}',
            "",
            [("f", {}), ("g", {"y": 2})],
        ),
        ("auto", "json", "The answer is {1}.", "The answer is {1}.", []),
        ("auto", "json", '{"not": "a call"}', '{"not": "a call"}', []),
        (
            "required",
            "hermes",
            '[{"name": "f", "parameters": {"a": [1]}}, {"name": "g", "parameters": {}}]',
            "",
            [("f", {"a": [1]}), ("g", {})],
        ),
        ("required", "json", '[{"name": "f", "parame', '[{"name": "f", "parame', []),
        ("auto", "hermes", f"<tool_call>{DEEP}</tool_call>", f"<tool_call>{DEEP}</tool_call>", []),
        ("required", "hermes", DEEP, DEEP, []),
    ],
    ids=[
        "none-keeps-text",
        "auto-plain",
        "auto-hermes-call",
        "auto-hermes-text-and-two-calls",
        "auto-hermes-bad-block-stays-content",
        "auto-hermes-tag-prefix-flushed-at-end",
        "auto-hermes-unclosed-call-at-end",
        "auto-json-call",
        "auto-json-two-calls",
        "auto-json-text",
        "auto-json-object-not-a-call",
        "required-array",
        "required-cut-short",
        "auto-nested-past-python-s-limit-stays-content",
        "required-nested-past-python-s-limit-stays-content",
    ],
)
def test_text_becomes_content_and_calls(
    mode: ToolMode, fmt: str, text: str, content: str, calls: list[tuple[str, dict[str, object]]], size: int
) -> None:
    parser = ToolCallParser(mode, fmt)  # type: ignore[arg-type]
    assert _run(parser, _pieces(text, size)) == (content, calls)
    assert parser.num_calls == len(calls)


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    parser = ToolCallParser("named", name="get_weather")
    first = parser.feed('{"city"')
    assert isinstance(first[0], ToolCallDelta) and first[0].function.name == "get_weather" and first[0].id
    later = parser.feed(': "Paris"}')
    assert [event.function.arguments for event in later if isinstance(event, ToolCallDelta)] == [': "Paris"}']
    assert parser.close() == []


def test_hermes_holds_back_only_what_may_start_a_tag() -> None:
    parser = ToolCallParser("auto", "hermes")
    assert parser.feed("Hello <to") == ["Hello "]
    assert parser.feed("day") == ["<today"]
