"""The worker's tokenizer route, and an orchestrator without the model folder that uses it.

A real worker (engine on the tiny Llama, both apps in process) behind an orchestrator whose model has
no ``model_path`` (a Kubernetes hf:// model): the orchestrator fetches the worker's tokenizer, then
its block hashes for a prompt are the very blocks the worker cached for it (DESIGN.md section 4).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI
from support.asgi_stream import StreamingASGITransport
from support.gateway_fakes import wait_for
from support.upstream_fakes import HttpxUpstream
from support.worker_server import engine_config

from herd.api.crd import KVCacheAwareRouting
from herd.api.kv_hash import block_hashes
from herd.api.openai import ChatCompletionRequest
from herd.api.prompt import PromptRenderer, read_tokenizer_files
from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER, WORKER_HEADER, TokenizerFiles
from herd.orchestrator.app import AppSettings, build_app
from herd.orchestrator.discovery import ModelConfig, StaticSource, WorkerEndpoint
from herd.orchestrator.registry import RegistrySettings
from herd.orchestrator.tokens import prompt_token_ids
from herd.worker.async_engine import AsyncEngine
from herd.worker.model_runner import torch_engine
from herd.worker.server import PublicOptions, build_internal_app, build_public_app

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

TOKEN = "internal-secret"
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "You are a careful assistant. " * 8}],
    "max_tokens": 1,
    "temperature": 0,
}


class _ByHost(httpx.AsyncBaseTransport):
    """One upstream client for the orchestrator, reaching each in-process app by host name."""

    def __init__(self, apps: dict[str, httpx.AsyncBaseTransport]) -> None:
        self.apps = apps

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.apps[request.url.host].handle_async_request(request)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: Path) -> AsyncIterator[AsyncEngine]:
    front = AsyncEngine(lambda: torch_engine(engine_config(tiny_llama)))
    front.start()
    await front.wait_loaded()
    yield front
    await front.stop()


@pytest.mark.parametrize(("token", "status"), [(None, 401), ("wrong", 401), (TOKEN, 200)], ids=str)
async def test_the_route_is_token_guarded(engine: AsyncEngine, token: str | None, status: int) -> None:
    transport = httpx.ASGITransport(app=build_internal_app(engine, TOKEN))
    headers = {TOKEN_HEADER: token} if token else {}
    async with httpx.AsyncClient(transport=transport, base_url="http://worker", headers=headers) as client:
        response = await client.get(INTERNAL_PATHS.tokenizer)
    assert response.status_code == status
    if status == 401:
        assert TOKEN_HEADER in response.json()["error"]["message"]


async def test_the_route_serves_what_the_worker_renders_with(engine: AsyncEngine, tiny_llama: Path) -> None:
    transport = httpx.ASGITransport(app=build_internal_app(engine, TOKEN))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://worker", headers={TOKEN_HEADER: TOKEN}
    ) as client:
        response = await client.get(INTERNAL_PATHS.tokenizer)
    files = TokenizerFiles.model_validate_json(response.content).files
    assert files == read_tokenizer_files(tiny_llama)
    messages = [{"role": "user", "content": "Hello there"}]
    assert PromptRenderer.from_files(files).encode_chat(messages) == engine.renderer.encode_chat(messages)


async def test_an_orchestrator_without_the_folder_hashes_as_the_worker(
    engine: AsyncEngine, tiny_llama: Path
) -> None:
    apps: dict[str, httpx.AsyncBaseTransport] = {
        "worker.test": httpx.ASGITransport(
            app=build_public_app(engine, PublicOptions("tiny", max_body_bytes=1 << 20))
        ),
        "worker.internal": StreamingASGITransport(build_internal_app(engine, TOKEN)),
    }
    model = ModelConfig("tiny", KVCacheAwareRouting(strategy="kv_cache_aware"), block_size=16)
    endpoint = WorkerEndpoint("w0", "tiny", "http://worker.test", "http://worker.internal")
    settings = AppSettings(internal_token=TOKEN, registry=RegistrySettings(poll_interval=0.05))
    async with httpx.AsyncClient(transport=_ByHost(apps)) as upstream:
        app = build_app(
            StaticSource([model], [endpoint]),
            settings=settings,
            http=upstream,
            upstream=HttpxUpstream(upstream),
        )
        served_hashes = await _serve_and_fetch(app, tiny_llama)
    assert served_hashes


async def _serve_and_fetch(app: FastAPI, tiny_llama: Path) -> list[int]:
    """Serve the chat before and after the fetch; the worker's cached blocks reach the orchestrator."""
    registry = app.state.registry
    async with app.router.lifespan_context(app):
        await wait_for(lambda: "w0" in registry.workers and registry.workers["w0"].is_healthy, within=10.0)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://o") as client:
            first = await client.post("/v1/chat/completions", json=CHAT)
            assert first.status_code == 200 and first.headers[WORKER_HEADER] == "w0"
            served = registry.models["tiny"]
            await wait_for(lambda: not served.wants_worker_tokenizer, within=10.0)
            hashes: list[int] = block_hashes(
                prompt_token_ids(served.renderer, ChatCompletionRequest.model_validate(CHAT)),
                16,
                model_id="tiny",
            )
            local = prompt_token_ids(
                PromptRenderer.from_pretrained(tiny_llama), ChatCompletionRequest.model_validate(CHAT)
            )
            assert hashes == block_hashes(local, 16, model_id="tiny") and len(hashes) >= 4
            await wait_for(lambda: served.kv_index.match(hashes).get("w0") == len(hashes), within=10.0)
            second = await client.post("/v1/chat/completions", json=CHAT)
            assert second.status_code == 200
    return hashes
