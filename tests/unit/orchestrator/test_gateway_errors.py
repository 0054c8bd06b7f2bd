"""Every error the gateway answers is the OpenAI envelope: validation at the door (400 naming the
field), lengths against maxModelLen, routing errors (404, 405), 422, 500 and 503."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway

from herd.api.crd import KVCacheAwareRouting
from herd.orchestrator.errors import INTERNAL_ERROR

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    """The response's error body, checked to be exactly the OpenAI envelope with ``status``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def one_worker() -> FakeCluster:
    return FakeCluster([FakeWorker("w0")])


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (CHAT_PATH, {"model": MODEL, "prompt": "hi"}, "messages", "`messages` is required"),
        (COMPLETIONS_PATH, {"model": MODEL, "messages": HI}, "prompt", "`prompt` is required"),
        (CHAT_PATH, {"messages": HI}, "model", "`model` is required"),
        (CHAT_PATH, {"model": 7, "messages": HI}, "model", "valid string"),
        (CHAT_PATH, {"model": MODEL, "messages": []}, "messages", "at least one message"),
        (
            CHAT_PATH,
            {"model": MODEL, "messages": HI, "temperature": 5},
            "temperature",
            "less than or equal to 2",
        ),
        (
            CHAT_PATH,
            {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
            "messages.0.role",
            "'user'",
        ),
        (
            CHAT_PATH,
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            "messages.0.content",
            "expected one of str",
        ),
        (CHAT_PATH, {"model": MODEL, "messages": HI, "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        (
            CHAT_PATH,
            {"model": MODEL, "messages": HI, "max_tokens": 0},
            "max_tokens",
            "greater than or equal to 1",
        ),
        (COMPLETIONS_PATH, {"model": MODEL, "prompt": []}, "prompt", "must not be empty"),
        (COMPLETIONS_PATH, {"model": MODEL, "prompt": {"a": 1}}, "prompt", "valid"),
    ],
    ids=[
        "chat-without-messages",
        "completion-without-prompt",
        "no-model",
        "model-not-a-string",
        "no-messages",
        "temperature-too-high",
        "unknown-role",
        "content-not-text",
        "logit-bias-key-not-an-id",
        "max-tokens-zero",
        "empty-prompt",
        "prompt-an-object",
    ],
)
async def test_an_invalid_request_is_a_400_naming_the_field(
    path: str, body: dict[str, Any], param: str, words: str
) -> None:
    cluster = one_worker()
    async with running_gateway(cluster) as (_, client):
        response = await client.post(path, json=body)
    error = envelope(response, 400)
    assert error["param"] == param and words in error["message"], error
    assert error["message"].startswith("invalid request: ") and "\n" not in error["message"]
    assert not any(dump in error["message"] for dump in ("pydantic", "input_value", "type="))
    assert cluster.workers[0].num_requests == 0  # refused at the door


@pytest.mark.parametrize(
    ("content", "words"),
    [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object")],
    ids=["not-json", "not-an-object"],
)
async def test_a_body_that_is_not_a_json_object_is_a_400(content: bytes, words: str) -> None:
    async with running_gateway(one_worker()) as (_, client):
        response = await client.post(CHAT_PATH, content=content, headers={"content-type": "application/json"})
    assert words in envelope(response, 400)["message"]


async def test_a_body_that_is_not_json_by_its_content_type_is_a_415() -> None:
    cluster = one_worker()
    async with running_gateway(cluster) as (_, client):
        response = await client.post(CHAT_PATH, content=b"model=tiny", headers={"content-type": "text/plain"})
    assert "application/json" in envelope(response, 415)["message"]
    assert cluster.workers[0].num_requests == 0


async def test_deeply_nested_json_is_a_400() -> None:
    depth = 100_000
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "user": '
    body += b"[" * depth + b"]" * depth + b"}"
    cluster = one_worker()
    async with running_gateway(cluster) as (_, client):
        response = await client.post(CHAT_PATH, content=body, headers={"content-type": "application/json"})
    envelope(response, 400)
    assert cluster.workers[0].num_requests == 0


async def test_the_raw_body_is_forwarded_as_it_came() -> None:
    cluster = one_worker()
    seen: list[bytes] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == CHAT_PATH:
            seen.append(request.content)
        return cluster.workers[0].handle(request)

    cluster.transport = lambda: httpx.MockTransport(handle)  # type: ignore[method-assign]
    body = b'{"model": "tiny",  "messages": [{"role": "user", "content": "hi"}], "x_unknown": [1]}'
    async with running_gateway(cluster) as (_, client):
        response = await client.post(CHAT_PATH, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200 and seen == [body]


LENGTH_CASES = {
    "prompt-too-long": (CHAT_PATH, {"messages": [{"role": "user", "content": "llama " * 200}]}, "messages"),
    "output-too-long": (CHAT_PATH, {"messages": HI, "max_tokens": 60}, "max_tokens"),
    "completion-tokens-too-long": (
        CHAT_PATH,
        {"messages": HI, "max_completion_tokens": 60},
        "max_completion_tokens",
    ),
    "text-prompt-too-long": (COMPLETIONS_PATH, {"prompt": "llama " * 200}, "prompt"),
}


@pytest.mark.parametrize(("path", "fields", "param"), list(LENGTH_CASES.values()), ids=list(LENGTH_CASES))
async def test_lengths_past_max_model_len_are_a_400_when_the_prompt_is_tokenized(
    tiny_llama: Path, path: str, fields: dict[str, Any], param: str
) -> None:
    cluster = one_worker()
    routing = KVCacheAwareRouting(strategy="kv_cache_aware")
    config = {"model_path": tiny_llama, "max_model_len": 64}
    async with running_gateway(cluster, routing=routing, model_config=config) as (_, client):
        refused = await client.post(path, json={"model": MODEL, **fields})
        fitting = await client.post(CHAT_PATH, json={"model": MODEL, "messages": HI, "max_tokens": 8})
    error = envelope(refused, 400)
    assert error["param"] == param and "maxModelLen" in error["message"], error
    assert fitting.status_code == 200 and cluster.workers[0].num_requests == 1


async def test_an_unknown_model_is_a_404_naming_the_param() -> None:
    async with running_gateway(one_worker()) as (_, client):
        response = await client.post(CHAT_PATH, json={"model": "nope", "messages": HI})
    error = envelope(response, 404)
    assert error["param"] == "model" and "nope" in error["message"] and error["type"] == "not_found_error"


async def test_an_unknown_route_is_a_404() -> None:
    async with running_gateway(one_worker()) as (_, client):
        response = await client.get("/v1/rerank")
    assert "/v1/rerank" in envelope(response, 404)["message"]


async def test_a_wrong_method_is_a_405_naming_the_allowed_one() -> None:
    async with running_gateway(one_worker()) as (_, client):
        response = await client.get(CHAT_PATH)
    error = envelope(response, 405)
    assert "POST" in error["message"] and error["type"] == "invalid_request_error"
    assert response.headers["allow"] == "POST"


async def test_a_parameter_validation_error_is_a_422() -> None:
    async with running_gateway(one_worker()) as (app, client):

        async def typed(limit: int) -> dict[str, int]:
            return {"limit": limit}

        app.add_api_route("/typed", typed, methods=["GET"])  # a route FastAPI validates itself
        response = await client.get("/typed", params={"limit": "many"})
    assert envelope(response, 422)["param"] == "limit"


async def test_an_unexpected_exception_is_a_500_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    async with running_gateway(one_worker()) as (app, client):

        async def broken(*_: object) -> None:
            raise RuntimeError("a bug deep in the gateway")

        app.state.gateway.forward = broken
        with caplog.at_level(logging.ERROR):
            response = await client.post(CHAT_PATH, json={"model": MODEL, "messages": HI})
    error = envelope(response, 500)
    assert error["message"] == INTERNAL_ERROR and "bug" not in error["message"]
    failures = [record for record in caplog.records if record.exc_info]
    assert len(failures) == 1 and "a bug deep in the gateway" in str(failures[0].exc_info[1])  # type: ignore[index]


async def test_no_healthy_worker_is_a_503_with_retry_after() -> None:
    cluster = one_worker()
    async with running_gateway(cluster) as (app, client):
        app.state.registry.workers["w0"].is_healthy = False
        response = await client.post(CHAT_PATH, json={"model": MODEL, "messages": HI})
    assert envelope(response, 503)["type"] == "service_unavailable"
    assert response.headers["retry-after"] == "1"
