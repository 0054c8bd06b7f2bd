"""Structured outputs through the unmodified ``openai`` SDK against a real ``herd worker`` and gateway
(issue 15): ``parse`` with a pydantic model, 50 generated JSON schemas, regex and choice, and the 400s."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from support.live_cluster import MODEL, WorkerPorts, live_orchestrator, live_worker, write_manifest
from support.schemas import varied_schemas

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

QUESTION = [{"role": "user", "content": "Which city is the capital of France?"}]
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    """Every string bounded: a random-weight model would fill an unbounded one to its token limit."""

    name: Literal["Paris", "Berlin", "Rome", "Madrid"]
    country: str = Field(max_length=12)
    population: int = Field(ge=0, le=50_000_000)
    is_capital: bool
    districts: list[Annotated[str, Field(max_length=10)]] = Field(max_length=3)


@pytest.fixture(scope="module")
def worker(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPorts]:
    ports = WorkerPorts.fresh()
    log = tmp_path_factory.mktemp("structured") / "worker.log"
    with live_worker(tiny_llama, ports, log=log, max_model_len="1024", kv_memory_gib="0.1"):
        yield ports


@pytest.fixture(scope="module")
def gateway(tiny_llama: Path, worker: WorkerPorts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("structured-gateway")
    manifest = write_manifest(folder, tiny_llama, engine={"maxModelLen": 1024}, routing="kv_cache_aware")
    with live_orchestrator(manifest, [worker], log=folder / "orchestrator.log") as gateway:
        yield gateway.url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("through", ["worker", "gateway"])
def test_parse_returns_a_valid_pydantic_object(worker: WorkerPorts, gateway: str, through: str) -> None:
    client = _client(worker.url if through == "worker" else gateway)
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.parse(
            model=MODEL,
            messages=QUESTION,
            response_format=City,
            max_tokens=300,
            temperature=temperature,
            seed=7,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, City)
        assert City.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_fifty_generated_schemas_all_validate(worker: WorkerPorts) -> None:
    schemas = varied_schemas(50, seed=15)
    client = _client(worker.url)

    def ask(index_schema: tuple[int, dict[str, Any]]) -> tuple[dict[str, Any], str, str | None]:
        index, schema = index_schema
        completion = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Give me object number {index} as JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{index}", "schema": schema, "strict": True},
            },
            max_tokens=400,
            temperature=0.8 if index % 2 else 0.0,
            seed=index,
        )
        return schema, completion.choices[0].message.content or "", completion.choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:  # concurrent, so the engine batches them
        results = list(pool.map(ask, enumerate(schemas)))
    for schema, text, finish_reason in results:
        assert finish_reason == "stop", (text, schema)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice(worker: WorkerPorts) -> None:
    client = _client(worker.url)
    as_object = client.chat.completions.create(
        model=MODEL, messages=QUESTION, response_format={"type": "json_object"}, max_tokens=200
    )
    assert isinstance(json.loads(as_object.choices[0].message.content or ""), dict)
    regex = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=20, temperature=1.0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
    )  # fmt: skip
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", regex.choices[0].text)
    choice = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=10, n=4, temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["Paris", "Berlin", "Rome"]}},
    )  # fmt: skip
    assert {c.message.content for c in choice.choices} <= {"Paris", "Berlin", "Rome"}


def test_a_streamed_constrained_answer_joins_to_valid_json(worker: WorkerPorts) -> None:
    stream = _client(worker.url).chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "City",
                "schema": {**City.model_json_schema(), "additionalProperties": False},
            },
        },
        max_tokens=300,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    City.model_validate_json(text)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
    ],
    ids=[
        "bad-schema",
        "no-schema",
        "bad-regex",
        "bad-grammar",
        "two-constraints",
        "refused-audio",
        "unknown-tool",
    ],
)
@pytest.mark.parametrize("through", ["worker", "gateway"])
def test_a_constraint_that_does_not_compile_is_a_400_naming_it(
    worker: WorkerPorts, gateway: str, through: str, body: dict[str, Any], param: str
) -> None:
    url = worker.url if through == "worker" else gateway
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 5, **body},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def _call_turn(
    client: openai.OpenAI, tool_choice: Any, *, stream: bool
) -> tuple[str | None, list[dict[str, Any]]]:
    """One assistant turn with tools: its finish reason and its tool calls (streamed deltas joined)."""
    fields: dict[str, Any] = {"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER_TOOL, TIME_TOOL],
                              "tool_choice": tool_choice, "max_tokens": 200, "temperature": 0.7, "seed": 2}  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**fields).choices[0]
        assert choice.message.content is None
        calls = [call.model_dump() for call in choice.message.tool_calls or []]
        return choice.finish_reason, calls
    joined: dict[int, dict[str, Any]] = {}
    finish_reason = None
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                if delta.index not in joined:  # a call's first delta carries its id, type and name
                    assert delta.id and delta.type == "function" and delta.function and delta.function.name
                    joined[delta.index] = {
                        "id": delta.id,
                        "type": "function",
                        "function": {"name": delta.function.name, "arguments": ""},
                    }
                joined[delta.index]["function"]["arguments"] += (
                    delta.function and delta.function.arguments
                ) or ""
    return finish_reason, [joined[index] for index in sorted(joined)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
@pytest.mark.parametrize("through", ["worker", "gateway"])
def test_a_tool_round_trip_call_result_answer(
    worker: WorkerPorts, gateway: str, through: str, tool_choice: Any, stream: bool
) -> None:
    client = _client(worker.url if through == "worker" else gateway)
    finish_reason, calls = _call_turn(client, tool_choice, stream=stream)
    assert finish_reason == "tool_calls"
    assert calls and (len(calls) == 1 or tool_choice == "required")
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER_TOOL, TIME_TOOL)}
    for call in calls:
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    if isinstance(tool_choice, dict):
        assert calls[0]["function"]["name"] == "get_weather"
    history = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": call["id"], "content": "22 degrees, sunny"} for call in calls),
    ]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="none",
        max_tokens=12,
        stream=stream,
    )
    if stream:
        chunks = [chunk.choices[0] for chunk in answer if chunk.choices]
        assert "".join(c.delta.content or "" for c in chunks) and not any(c.delta.tool_calls for c in chunks)
        assert chunks[-1].finish_reason in {"stop", "length"}
    else:
        message = answer.choices[0].message
        assert message.content and not message.tool_calls
        assert answer.choices[0].finish_reason in {"stop", "length"}


def test_auto_parses_the_models_hermes_calls(worker: WorkerPorts) -> None:
    """With ``auto`` the model's own text is parsed; a grammar makes the random model write a call."""
    call = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>'
    )
    choice = _client(worker.url).chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=200,
        extra_body={"structured_outputs": {"choice": [call]}},
    ).choices[0]  # fmt: skip
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Rome", "unit": "celsius"}


def test_the_gateway_and_the_worker_render_tools_alike(worker: WorkerPorts, tiny_llama: Path) -> None:
    from herd.api.openai import ChatCompletionRequest
    from herd.api.prompt import PromptRenderer

    body = {"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER_TOOL]}
    rendered = httpx.post(f"{worker.url}/v1/chat/completions/render", json=body, timeout=30).json()[
        "token_ids"
    ]
    ours = PromptRenderer.from_pretrained(tiny_llama).chat_request_ids(
        ChatCompletionRequest.model_validate(body)
    )
    assert rendered == ours
    assert "get_weather" in PromptRenderer.from_pretrained(tiny_llama).decode(ours)
