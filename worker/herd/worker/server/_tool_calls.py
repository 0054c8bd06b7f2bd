"""Turning a chat choice's generated text into content and tool calls, as it streams.

``ToolCallParser.feed`` takes each new piece of text and returns what may be sent now: content
text, or ``ToolCallDelta``s the way the OpenAI API streams calls (the first delta of a call carries
its index, id, type and name; later ones add to its ``arguments``). ``close`` returns the rest.
By tool choice:

* ``none`` (or no tools): all text is content.
* a named function: the grammar made the text that function's arguments object; the call's header
  goes out at once and the text streams as its arguments.
* ``required``: the grammar made the text a JSON array of ``{"name", "parameters"}``; the calls go
  out when it is complete.
* ``auto``: the model chose, in its family's format (``herd.api.tools``). Hermes: text streams as
  content except ``<tool_call>...</tool_call>`` blocks, each a call once closed (a tail that may
  be the start of a tag is held back). JSON (Llama 3): an answer that opens with ``{`` is held
  until the end and is calls if it parses as ``{"name", "parameters"}`` objects (``;``-separated),
  else content.

A block that does not parse as a call is passed on as content: nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from herd.api.body import json_value
from herd.api.openai import FunctionCallDelta, NamedToolChoice, ToolCallDelta
from herd.api.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolFormat

__all__ = ["Event", "ToolCallParser", "ToolMode", "new_call_id"]

ToolMode = Literal["none", "auto", "required", "named"]
Event = str | ToolCallDelta
"""Content text, or one tool-call delta."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    def __init__(
        self, mode: ToolMode, tool_format: ToolFormat = "hermes", *, name: str | None = None
    ) -> None:
        self.mode = mode
        self.format = tool_format
        self.name = name
        self.num_calls = 0
        self._buffer = ""
        self._holding = False
        """``json`` format: the answer opened like a call and is held to the end."""

    @classmethod
    def for_choice(cls, choice: str | NamedToolChoice, tool_format: ToolFormat) -> ToolCallParser:
        if isinstance(choice, NamedToolChoice):
            return cls("named", tool_format, name=choice.function.name)
        mode: ToolMode = "required" if choice == "required" else "auto" if choice == "auto" else "none"
        return cls(mode, tool_format)

    def feed(self, text: str) -> list[Event]:
        match self.mode:
            case "none":
                return [text] if text else []
            case "named":
                return self._named(text)
            case "required":
                self._buffer += text
                return []
            case "auto" if self.format == "hermes":
                self._buffer += text
                return self._hermes(final=False)
            case _:
                return self._json_auto(text)

    def close(self) -> list[Event]:
        match self.mode:
            case "required":
                return self._required()
            case "auto" if self.format == "hermes":
                return self._hermes(final=True)
            case "auto" if self._holding:
                return self._json_calls(self._buffer)
            case _:
                return []

    def _call(self, name: str, arguments: str) -> ToolCallDelta:
        delta = ToolCallDelta(
            index=self.num_calls,
            id=new_call_id(),
            type="function",
            function=FunctionCallDelta(name=name, arguments=arguments),
        )
        self.num_calls += 1
        return delta

    def _named(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.num_calls == 0:
            events.append(self._call(self.name or "", ""))
        if text:
            events.append(ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text)))
        return events

    def _required(self) -> list[Event]:
        try:
            calls = json_value(self._buffer, what="the tool calls")
        except ValueError:
            return [self._buffer] if self._buffer else []  # cut short (length): the text as it is
        return [
            self._call(str(call["name"]), json.dumps(call["parameters"], ensure_ascii=False))
            for call in calls
            if isinstance(call, dict) and "name" in call and "parameters" in call
        ]

    def _hermes(self, *, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buffer, TOOL_CALL_OPEN)
                _add_content(events, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return events
            end = self._buffer.find(TOOL_CALL_CLOSE, start)
            if end < 0 and not final:
                _add_content(events, self._buffer[:start])
                self._buffer = self._buffer[start:]
                return events
            _add_content(events, self._buffer[:start])
            block_end = len(self._buffer) if end < 0 else end + len(TOOL_CALL_CLOSE)
            block = self._buffer[start:block_end]
            call = _parse_call(block[len(TOOL_CALL_OPEN) :].removesuffix(TOOL_CALL_CLOSE), "arguments")
            events.append(block if call is None else self._call(*call))
            self._buffer = self._buffer[block_end:]

    def _json_auto(self, text: str) -> list[Event]:
        if self._holding:
            self._buffer += text
            return []
        self._buffer += text
        stripped = self._buffer.lstrip()
        if not stripped:
            return []
        if stripped.startswith("{"):
            self._holding = True
            return []
        self.mode = "none"  # plain content from here on
        content, self._buffer = self._buffer, ""
        return [content]

    def _json_calls(self, text: str) -> list[Event]:
        parts = [part for part in text.split(";") if part.strip()]
        calls = [_parse_call(part, "parameters") for part in parts]
        if not calls or any(call is None for call in calls):
            return [text]
        return [self._call(*call) for call in calls if call is not None]


def _parse_call(text: str, arguments_key: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one call object, or None when ``text`` is not one."""
    try:
        value: Any = json_value(text, what="a tool call")
    except ValueError:  # not JSON, or nested too deep to be a call
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _add_content(events: list[Event], text: str) -> None:
    if text:
        events.append(text)
