"""DESIGN.md section 4: the orchestrator's block hashes for a request equal the worker's.

The worker serves a chat request (its own rendering, tokenization and prefix cache); the
orchestrator computes the hashes it would route on from the same request body. Every one of them
must name a block the worker now holds, and the worker must hold no other block of that prompt.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support.lora import make_peft_adapter
from support.worker_server import engine_config

from herd.api import PromptRenderer, block_hashes
from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER
from herd.orchestrator.tokens import prompt_token_ids
from herd.orchestrator.validation import WIRE_MODELS
from herd.worker.async_engine import AsyncEngine
from herd.worker.model_runner import torch_engine
from herd.worker.server import PublicOptions, build_internal_app, build_public_app

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
TOKEN = "t"
LONG_SYSTEM = "You are a careful assistant. " * 6


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    adapter = make_peft_adapter(tiny_llama, tmp_path_factory.mktemp("hash-lora") / "sql", rank=4, seed=1)
    config = engine_config(tiny_llama, maxModelLen=1024)  # room for tools
    config = config.model_copy(update={"lora_modules": {"sql": adapter}})
    engine = AsyncEngine(lambda: torch_engine(config))
    engine.start()
    await engine.wait_loaded()
    public = httpx.ASGITransport(app=build_public_app(engine, PublicOptions("tiny", max_body_bytes=1 << 20)))
    internal = httpx.ASGITransport(app=build_internal_app(engine, TOKEN))
    async with (
        httpx.AsyncClient(transport=public, base_url="http://worker") as public_client,
        httpx.AsyncClient(
            transport=internal, base_url="http://worker", headers={TOKEN_HEADER: TOKEN}
        ) as internal_client,
    ):
        yield public_client, internal_client
    await engine.stop()


@pytest.mark.parametrize(
    "body",
    [
        {
            "messages": [
                {"role": "system", "content": LONG_SYSTEM},
                {"role": "user", "content": "Hello there"},
            ]
        },
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": LONG_SYSTEM}]}],
            "cache_salt": "tenant-7",
        },
        {"prompt": LONG_SYSTEM + "Once upon a time"},
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [
                {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
            ],
        },
        {"prompt": LONG_SYSTEM + "Once upon a time", "model": "sql"},
    ],
    ids=["chat", "chat-parts-salted", "completion", "chat-tools", "lora-adapter"],
)
async def test_orchestrator_hashes_equal_the_workers(
    worker: tuple[httpx.AsyncClient, httpx.AsyncClient], tiny_llama: Path, body: dict[str, Any]
) -> None:
    public, internal = worker
    request = {"model": "tiny", "max_tokens": 1, "temperature": 0, **body}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = await public.post(path, json=request)
    assert response.status_code == 200, response.text

    snapshot = (await internal.get(INTERNAL_PATHS.kv_snapshot)).json()
    token_ids = prompt_token_ids(
        PromptRenderer.from_pretrained(tiny_llama), WIRE_MODELS[path].model_validate(request)
    )
    lora_name = None if request["model"] == "tiny" else request["model"]
    expected = block_hashes(
        token_ids,
        snapshot["block_size"],
        model_id="tiny",
        cache_salt=request.get("cache_salt"),
        lora_name=lora_name,
    )
    assert len(expected) >= 4, "the prompt should span several full blocks"
    assert response.json()["usage"]["prompt_tokens"] == len(token_ids)
    assert set(expected) <= set(snapshot["block_hashes"])
    unsalted = block_hashes(token_ids, snapshot["block_size"], model_id="tiny")
    if request.get("cache_salt") or lora_name:
        assert not set(unsalted) & set(expected)
