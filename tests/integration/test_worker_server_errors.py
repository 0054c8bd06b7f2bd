"""Every error of the worker's public port in the OpenAI envelope, one readable sentence, and its
OpenAPI document (what schemathesis fuzzes). 429, 500 and 503 have their own tests, which need a held,
faulty or draining engine: test_worker_server.py, test_worker_faults.py, test_worker_server_async_engine.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support.worker_server import engine_config

from herd.worker.async_engine import AsyncEngine
from herd.worker.model_runner import torch_engine
from herd.worker.server import PublicOptions, build_public_app

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_llama: Path) -> AsyncIterator[httpx.AsyncClient]:
    config = engine_config(tiny_llama)
    engine = AsyncEngine(lambda: torch_engine(config))
    engine.start()
    await engine.wait_loaded()
    app = build_public_app(engine, PublicOptions("tiny", max_body_bytes=20_000, max_queue_len=4))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        yield client
    await engine.stop()


def chat(**fields: Any) -> dict[str, Any]:
    return {"json": {"model": "tiny", "messages": HELLO, "max_tokens": 2, **fields}}


@pytest.mark.parametrize(
    ("method", "path", "request_args", "status", "param", "words"),
    [
        (
            "POST",
            CHAT,
            chat(max_tokens="many"),
            400,
            "max_tokens",
            "invalid request: `max_tokens`: input should be a valid",
        ),
        ("POST", CHAT, {"json": {"model": "tiny"}}, 400, "messages", "`messages` is required"),
        (
            "POST",
            "/v1/completions",
            {"json": {"model": "tiny", "prompt": 5}},
            400,
            "prompt",
            "expected one of str, list[str], list[int], list[list[int]] (got 5)",
        ),
        (
            "POST",
            CHAT,
            chat(chat_template_kwargs={"messages": []}),
            400,
            "chat_template_kwargs",
            "may not set",
        ),
        ("POST", CHAT, chat(logit_bias={"\u00b2": 1}), 400, "logit_bias", "decimal integers"),
        ("POST", CHAT, chat(logit_bias={"-1": 1}), 400, "logit_bias", "token id -1 in logit_bias"),
        ("POST", CHAT, chat(top_k=10**30), 400, "top_k", "exceeds this model's vocabulary"),
        (
            "POST",
            "/v1/completions",
            {"content": b'{"model": "tiny", "prompt": "a\\ud800b"}', "headers": JSON},
            400,
            "prompt",
            "not valid Unicode",
        ),
        (
            "POST",
            "/tokenize",
            {"content": b'{"prompt": "\\udfff"}', "headers": JSON},
            400,
            "prompt",
            "not valid Unicode",
        ),
        ("POST", "/detokenize", {"json": {"tokens": [1, -1]}}, 400, "tokens", "token id -1 in tokens"),
        (
            "POST",
            "/v1/completions",
            {"json": {"model": "tiny", "prompt": ""}},
            400,
            "prompt",
            "the prompt is empty",
        ),
        (
            "POST",
            CHAT,
            {"content": b'{"x": ' + b"[" * 70 + b"]" * 70 + b"}", "headers": JSON},
            400,
            None,
            "64 levels",
        ),
        (
            "POST",
            CHAT,
            chat(structured_outputs={"json": "[" * 5000 + "]" * 5000}),  # past Python's recursion limit
            400,
            "structured_outputs.json",
            "64 levels",
        ),
        (
            "POST",
            CHAT,
            chat(chat_template_kwargs={"raise_exception": 1}),
            400,
            "chat_template_kwargs",
            "may not set",
        ),
        (
            "POST",
            CHAT,
            {
                "content": b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "\\ud800"}',
                "headers": JSON,
            },
            400,
            "cache_salt",
            "lone UTF-16 surrogate",
        ),
        ("POST", CHAT, chat(logit_bias={"1" * 5000: 1}), 400, "logit_bias", "decimal integers"),
        (
            "POST",
            CHAT,
            chat(structured_outputs={"regex": "a{1000000}"}),  # compiles, then passes llguidance's limits
            400,
            "structured_outputs.regex",
            "could not be followed while generating",
        ),
        ("POST", CHAT, chat(n=5), 400, "n", "queues at most 4 (engine.maxQueueLen)"),
        (
            "POST",
            "/v1/completions",
            {"json": {"model": "tiny", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}},
            400,
            "prompt",
            "makes 6 sequences",
        ),
        ("POST", CHAT, chat(model="gpt-5"), 404, "model", "is not served here"),
        ("GET", "/v2/nothing", {}, 404, None, "there is no route GET /v2/nothing"),
        ("GET", CHAT, {}, 405, None, "GET is not allowed on /v1/chat/completions; use POST"),
        ("POST", "/health", {}, 405, None, "use GET"),
        ("POST", CHAT, chat(messages=[{"role": "user", "content": "x" * 30_000}]), 413, None, "20000 bytes"),
        ("POST", CHAT, {"content": b"{}", "headers": {"content-type": "text/plain"}}, 415, None, "not JSON"),
    ],
    ids=[
        "wrong-type",
        "chat-without-messages",
        "prompt-of-no-form",
        "reserved-template-variable",
        "non-ascii-digit-bias-key",
        "bias-id-outside-vocab",
        "huge-top-k",
        "lone-surrogate-prompt",
        "lone-surrogate-tokenize",
        "detokenize-bad-id",
        "empty-prompt",
        "too-deep",
        "structured-json-too-deep",
        "template-global-overridden",
        "lone-surrogate-cache-salt",
        "bias-key-of-5000-digits",
        "grammar-past-its-resource-limits",
        "more-choices-than-the-queue",
        "more-sequences-than-the-queue",
        "unknown-model",
        "unknown-route",
        "wrong-method",
        "wrong-method-health",
        "too-large",
        "not-json",
    ],
)
async def test_errors_are_one_sentence_in_the_envelope(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    request_args: dict[str, Any],
    status: int,
    param: str | None,
    words: str,
) -> None:
    response = await client.request(method, path, **request_args)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (status, param)
    assert words in error["message"]
    assert "\n" not in error["message"] and "input_value" not in error["message"]  # no pydantic dump
    assert (await client.post(CHAT, **chat())).status_code == 200


async def test_form_encoded_json_is_accepted_as_curl_d_sends_it(client: httpx.AsyncClient) -> None:
    body = b'{"model": "tiny", "prompt": "hello", "max_tokens": 1}'
    headers = {"content-type": "application/x-www-form-urlencoded"}
    assert (await client.post("/v1/completions", content=body, headers=headers)).status_code == 200


async def test_the_openapi_document_describes_every_route_and_body(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    bodies = {
        CHAT: "ChatCompletionRequest",
        "/v1/completions": "CompletionRequest",
        "/tokenize": "TokenizeRequest",
        "/detokenize": "DetokenizeRequest",
    }
    for path, name in bodies.items():
        operation = document["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(f"/{name}")
        assert name in schemas
        for status in ("400", "413", "415", "500", "503"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]
            assert error["$ref"].endswith("/ErrorResponse")
    for path in ("/v1/models", "/health", "/ready", "/metrics"):
        assert "get" in document["paths"][path]
    assert schemas["ChatCompletionRequest"]["properties"]["model"] == {"type": "string", "enum": ["tiny"]}
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert (await client.get("/docs")).status_code == (await client.get("/redoc")).status_code == 404
