"""The worker's side of resuming a stream (``herd.api.resume``), in process on the real engine: marks
only for herd's gateway, a continuation only from it, and a continuation that sends exactly the rest."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support.worker_server import engine_config

from herd.api.protocol import TOKEN_HEADER
from herd.api.resume import RESUMABLE_HEADER, RESUME_FIELD, parse_mark
from herd.worker.async_engine import AsyncEngine
from herd.worker.model_runner import torch_engine
from herd.worker.server import PublicOptions, build_public_app

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

TOKEN = "resume-token"
CHAT = "/v1/chat/completions"
GATEWAY = {TOKEN_HEADER: TOKEN, RESUMABLE_HEADER: "1", "X-Request-Id": "req-1"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_llama: Path) -> AsyncIterator[httpx.AsyncClient]:
    config = engine_config(tiny_llama)
    engine = AsyncEngine(lambda: torch_engine(config))
    engine.start()
    await engine.wait_loaded()
    app = build_public_app(engine, PublicOptions("tiny", internal_token=TOKEN))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        yield client
    await engine.stop()


def body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Count to ten"}],
        "max_tokens": 10,
        "temperature": 0.9,
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
        **fields,
    }


async def events(response: httpx.Response) -> list[str]:
    return [event for event in response.text.split("\n\n") if event]


def content(event: str) -> str:
    chunk = json.loads(event.removeprefix("data: "))
    return "".join(choice["delta"].get("content") or "" for choice in chunk["choices"])


async def test_marks_come_only_for_herds_gateway(client: httpx.AsyncClient) -> None:
    plain = await client.post(CHAT, json=body(), headers={RESUMABLE_HEADER: "1"})
    assert RESUMABLE_HEADER.lower() not in plain.headers
    assert not [event for event in await events(plain) if event.startswith(":")]
    marked = await client.post(CHAT, json=body(), headers=GATEWAY)
    assert marked.headers[RESUMABLE_HEADER.lower()] == "1"
    marks = [parse_mark(event.encode()) for event in await events(marked) if event.startswith(":")]
    assert all(found is not None for found in marks)
    assert sum(len(found.token_ids) for found in marks if found is not None) == 10
    assert [found.is_finished for found in marks if found is not None][-1]


async def test_a_continuation_sends_exactly_the_rest_of_the_stream(client: httpx.AsyncClient) -> None:
    whole = await events(await client.post(CHAT, json=body(), headers=GATEWAY))
    cut = [i for i, event in enumerate(whole) if event.startswith(":")][3]  # after the 4th mark
    sent, rest = whole[: cut + 1], whole[cut + 1 :]
    token_ids = [
        token for event in sent if (found := parse_mark(event.encode())) for token in found.token_ids
    ]
    created = json.loads(sent[0].removeprefix("data: "))["created"]
    resume = {"created": created, "choices": [{"index": 0, "token_ids": token_ids}]}
    resumed = await client.post(CHAT, json=body(**{RESUME_FIELD: resume}), headers=GATEWAY)
    assert resumed.status_code == 200, resumed.text
    again = await events(resumed)
    data = [event for event in again if event.startswith("data: {")]
    assert all(json.loads(event[6:])["id"] == "chatcmpl-req-1" for event in data)
    assert all(json.loads(event[6:])["created"] == created for event in data)
    assert "role" not in data[0]  # the client has its opening already
    expected = [event for event in rest if event.startswith("data: {")]
    assert "".join(map(content, data)) == "".join(map(content, expected))
    assert again[-1] == "data: [DONE]"


@pytest.mark.parametrize(
    ("fields", "headers", "status"),
    [
        ({RESUME_FIELD: {"choices": [{"index": 0, "token_ids": [5]}]}}, {}, 403),
        ({RESUME_FIELD: {"choices": [{"index": 0, "token_ids": [5]}]}}, {TOKEN_HEADER: "wrong"}, 403),
        ({RESUME_FIELD: {"choices": [{"index": 0, "token_ids": [5]}]}, "stream": False}, GATEWAY, 400),
        ({RESUME_FIELD: {"choices": [{"index": 3, "token_ids": [5]}]}}, GATEWAY, 400),
        ({RESUME_FIELD: {"choices": [{"index": 0, "token_ids": [10**7]}]}}, GATEWAY, 400),
        ({RESUME_FIELD: {"choices": [{"index": 0, "tokens": [5]}]}}, GATEWAY, 400),
    ],
    ids=["no-token", "wrong-token", "not-a-stream", "no-such-choice", "not-a-token", "unknown-field"],
)
async def test_a_continuation_is_refused_naming_the_field(
    client: httpx.AsyncClient, fields: dict[str, Any], headers: dict[str, str], status: int
) -> None:
    response = await client.post(CHAT, json=body(**fields), headers=headers)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"].startswith(RESUME_FIELD)
