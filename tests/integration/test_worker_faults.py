"""Requests that used to take a worker down: each gets a 400 naming its field, and the worker keeps serving."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support.worker_server import engine_config

from herd.worker.async_engine import AsyncEngine
from herd.worker.engine import LLMEngine
from herd.worker.server import PublicOptions, build_public_app

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "What is the capital of France?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_llama: Path) -> AsyncIterator[httpx.AsyncClient]:
    config = engine_config(tiny_llama)
    engine = AsyncEngine(lambda: LLMEngine(config))
    engine.start()
    await engine.wait_loaded()
    app = build_public_app(engine, PublicOptions("tiny"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        yield client
    await engine.stop()


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": HELLO, "max_tokens": 3, "temperature": 0, **fields}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"logit_bias": {"-1": 1}}, "logit_bias", "token id -1 in logit_bias"),
        ({"logit_bias": {"50000": 1}}, "logit_bias", "token id 50000 in logit_bias"),
        ({"stop_token_ids": [50000], "min_tokens": 2}, "stop_token_ids", "token id 50000 in stop_token_ids"),
        ({"stop_token_ids": [-3]}, "stop_token_ids", "token id -3 in stop_token_ids"),
    ],
    ids=[
        "negative-logit-bias-id",
        "logit-bias-id-past-vocab",
        "stop-id-past-vocab-with-min-tokens",
        "negative-stop-id",
    ],
)
async def test_a_token_id_outside_the_vocabulary_is_400_and_the_worker_serves_on(
    client: httpx.AsyncClient, fields: dict[str, Any], param: str, words: str
) -> None:
    response = await client.post(CHAT, json=chat_body(**fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert "outside this model's vocabulary (0..383)" in error["message"]
    assert (await client.post(CHAT, json=chat_body())).status_code == 200
    assert (await client.get("/health")).status_code == 200


async def test_deeply_nested_json_is_400_naming_the_limit(client: httpx.AsyncClient) -> None:
    nested = b'{"model": "tiny", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = await client.post(CHAT, content=nested, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert "64 levels" in response.json()["error"]["message"]
    assert (await client.post(CHAT, json=chat_body())).status_code == 200
