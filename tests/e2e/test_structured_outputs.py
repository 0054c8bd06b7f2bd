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
    ],
    ids=["bad-schema", "no-schema", "bad-regex", "bad-grammar", "two-constraints"],
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
