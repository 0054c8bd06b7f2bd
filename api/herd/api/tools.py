"""How tools and tool calls reach a chat template, and the text format a model calls tools in.

A template that knows tools (its source mentions ``tools``) gets them as the ``tools`` variable, as
``transformers`` passes them, and the history's messages as they came: assistant ``tool_calls``
(their ``arguments`` JSON text parsed into an object, which templates write with ``tojson``) and
``tool`` messages with their ``tool_call_id``. A template that does not (SmolLM2's, say) would
drop them, so herd writes them into the text instead, in the Hermes format that Qwen 2.5 uses:
the tool signatures and how to call them appended to the system message (one is added when the
conversation has none), each earlier call as a ``<tool_call>`` block in its assistant message,
and each tool result as a user message holding a ``<tool_response>`` block.

The model's format follows its template: ``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>``
blocks) when the template writes those tags or knows no tools, else ``json``, Llama 3's bare
``{"name", "parameters"}`` object. The gateway and the worker both render through here
(``PromptRenderer.chat_request_ids``), so their token ids agree.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from herd.api.body import json_value
from herd.api.openai import ChatCompletionRequest, ChatMessage

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ToolFormat",
    "chat_messages",
    "knows_tools",
    "tool_format",
]

ToolFormat = Literal["hermes", "json"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to answer the user. The functions you may call are "
    "listed as JSON signatures inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with one JSON object per call, each inside <tool_call></tool_call>:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
)


def knows_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def tool_format(template: str | None) -> ToolFormat:
    """The format the model writes tool calls in, judged from its chat template's source."""
    if template is None or TOOL_CALL_OPEN in template or not knows_tools(template):
        return "hermes"
    return "json"


def chat_messages(request: ChatCompletionRequest, *, template_knows_tools: bool) -> list[dict[str, Any]]:
    """The messages to render, with the request's tools and calls where the template will see them."""
    messages = [_message(message) for message in request.messages]
    if template_knows_tools or not (
        request.tools or any(m.tool_calls or m.role == "tool" for m in request.messages)
    ):
        return messages
    written = [
        _written(message, original) for message, original in zip(messages, request.messages, strict=True)
    ]
    if not request.tools:
        return written
    tools = "\n".join(
        json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False) for tool in request.tools
    )
    preamble = _TOOLS_PREAMBLE.format(tools=tools)
    if written and written[0]["role"] == "system":
        return [{**written[0], "content": f"{written[0]['content']}\n\n{preamble}"}, *written[1:]]
    return [{"role": "system", "content": preamble}, *written]


def _message(message: ChatMessage) -> dict[str, Any]:
    """One message as templates read it; only the keys a plain message has, unless it has more."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.role == "tool" and message.name is not None:
        rendered["name"] = message.name
    return rendered


def _arguments(text: str) -> Any:
    """Templates write arguments with ``tojson``: an object, when the text is one."""
    try:
        return json_value(text, what="a tool call's arguments")
    except ValueError:  # not JSON, or nested too deep to hand a template: the text as it came
        return text


def _written(message: dict[str, Any], original: ChatMessage) -> dict[str, Any]:
    """A message for a template that knows no tools: calls and results as Hermes text."""
    if original.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{original.text}\n</tool_response>"}
    if not original.tool_calls:
        return {"role": message["role"], "content": message["content"]}
    calls = [
        f"{TOOL_CALL_OPEN}\n"
        + json.dumps(
            {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}, ensure_ascii=False
        )
        + f"\n{TOOL_CALL_CLOSE}"
        for call in message["tool_calls"]
    ]
    content = "\n".join([message["content"], *calls] if message["content"] else calls)
    return {"role": message["role"], "content": content}
