"""Requests and faults that used to take a worker down.

Bad values get a 400 naming their field; an engine fault fails its own request (500, or an error
event ending its stream) or its own batch, and the worker keeps serving with ``/health`` at 200.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support.worker_server import engine_config, sse_data

from herd.worker import sampler as sampler_module
from herd.worker.async_engine import AsyncEngine
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine
from herd.worker.sequence import Sequence
from herd.worker.server import PublicOptions, build_public_app

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "What is the capital of France?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def core(tiny_llama: Path) -> LLMEngine:
    return torch_engine(engine_config(tiny_llama))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(core: LLMEngine) -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(lambda: core)
    engine.start()
    await engine.wait_loaded()
    yield engine
    await engine.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_public_app(engine, PublicOptions("tiny"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        yield client


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


async def _content(client: httpx.AsyncClient, **fields: Any) -> str:
    response = await client.post(CHAT, json=chat_body(max_tokens=6, ignore_eos=True, **fields))
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["message"]["content"]
    return text


async def _assert_serving(client: httpx.AsyncClient, core: LLMEngine, expected: str) -> None:
    assert (await client.get("/health")).status_code == 200
    assert await _content(client) == expected
    assert core.block_manager.num_free_blocks == core.block_manager.num_total_blocks


def _fail_doomed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request sent with ``X-Request-Id: doomed`` raises in its logit edits from its second token on
    (so that a stream has begun: its status is 200 and the error comes as its last event)."""
    edit = sampler_module.edit_logits

    def faulty(row: Any, seq: Sequence, eos: Any) -> None:
        if seq.request_id.startswith("doomed-") and seq.num_output_tokens >= 1:
            raise RuntimeError("injected sampling fault")
        edit(row, seq, eos)

    monkeypatch.setattr(sampler_module, "edit_logits", faulty)


@pytest.mark.parametrize("is_stream", [False, True], ids=["whole", "stream"])
async def test_a_request_the_engine_fails_gets_an_error_and_its_neighbour_its_tokens(
    client: httpx.AsyncClient, core: LLMEngine, monkeypatch: pytest.MonkeyPatch, is_stream: bool
) -> None:
    expected = await _content(client)
    _fail_doomed(monkeypatch)
    doomed = client.post(
        CHAT,
        json=chat_body(max_tokens=6, presence_penalty=0.5, stream=is_stream),
        headers={"X-Request-Id": "doomed"},
    )
    failed, neighbour = await asyncio.gather(doomed, _content(client))
    if is_stream:
        assert failed.status_code == 200
        events = sse_data(failed.text)
        assert "[DONE]" not in events
        assert events[1]["choices"][0]["delta"]["content"]  # the first token went out
        error = events[-1]["error"]
    else:
        assert failed.status_code == 500
        error = failed.json()["error"]
    assert error["type"] == "server_error"
    assert "during sampling: RuntimeError: injected sampling fault" in error["message"]
    assert neighbour == expected
    await _assert_serving(client, core, expected)


async def test_a_failed_forward_is_a_500_and_the_worker_serves_on(
    client: httpx.AsyncClient, core: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = await _content(client)
    execute, calls = core.runner.execute, []

    def fails_once(chunks: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected forward fault")
        return execute(chunks)

    monkeypatch.setattr(core.runner, "execute", fails_once)
    failed = await client.post(CHAT, json=chat_body())
    assert failed.status_code == 500
    assert "forward pass failed" in failed.json()["error"]["message"]
    await _assert_serving(client, core, expected)
