"""How tools and tool calls reach a chat template (issue 15, ``herd.api.tools``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from support.tiny_models import CHATML_TEMPLATE, train_tokenizer

from herd.api.openai import ChatCompletionRequest
from herd.api.prompt import PromptRenderer
from herd.api.tools import tool_format

TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
KNOWING_TEMPLATE = (
    "{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL={{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
)


def _render(template: str, body: dict[str, Any]) -> str:
    renderer = PromptRenderer(train_tokenizer(), chat_template=template)
    request = ChatCompletionRequest.model_validate({"model": "m", **body})
    return renderer.render_chat_request(request)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (None, "hermes"),
        (CHATML_TEMPLATE, "hermes"),
        ("{% if tools %}<tool_call>{% endif %}", "hermes"),
        ("{% if tools %}{{ tools | tojson }}{% endif %}", "json"),
    ],
    ids=["no-template", "template-without-tools", "hermes-template", "llama3-json-template"],
)
def test_the_call_format_follows_the_template(template: str | None, expected: str) -> None:
    assert tool_format(template) == expected


def test_a_template_that_knows_tools_gets_them_and_the_calls_as_objects() -> None:
    text = _render(KNOWING_TEMPLATE, {"messages": HISTORY, "tools": [TOOL]})
    assert text.startswith("TOOLS=" + json.dumps([TOOL]))
    assert 'CALL=weather{"city": "Paris"}' in text and "tool:sunny[call_1]" in text


def test_a_template_without_tools_gets_them_written_in_hermes_text() -> None:
    text = _render(CHATML_TEMPLATE, {"messages": HISTORY, "tools": [TOOL]})
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(TOOL) in text
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in text


def test_plain_messages_render_as_before() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    plain = PromptRenderer(train_tokenizer(), chat_template=CHATML_TEMPLATE).render_chat(messages)
    assert _render(CHATML_TEMPLATE, {"messages": messages}) == plain


def test_arguments_nested_past_the_body_limit_reach_the_template_as_text() -> None:
    deep = "[" * 5000 + "]" * 5000  # past Python's recursion limit: parsing it would raise
    call = {**CALL, "function": {"name": "weather", "arguments": deep}}
    history = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    text = _render(KNOWING_TEMPLATE, {"messages": history, "tools": [TOOL]})
    assert f"CALL=weather{json.dumps(deep)}" in text
