"""The worker's LoRA API in process (httpx.ASGITransport) on the real engine: the adapter chosen by
``model``, ``/v1/models`` with ``parent``, runtime load and unload behind the internal token, 404s in
the OpenAI envelope, ``vllm:lora_requests_info``, and the load report's adapters."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from support.lora import make_peft_adapter
from support.worker_server import engine_config

from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER
from herd.worker.async_engine import AsyncEngine
from herd.worker.model_runner import torch_engine
from herd.worker.server import PublicOptions, build_internal_app, build_public_app

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

TOKEN = "lora-token"
AUTH = {TOKEN_HEADER: TOKEN}


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("worker-loras")
    return {
        "sql": make_peft_adapter(tiny_llama, root / "sql", rank=8, seed=3),
        "poet": make_peft_adapter(tiny_llama, root / "poet", rank=4, seed=4),
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: Path, adapters: dict[str, Path]) -> AsyncIterator[AsyncEngine]:
    config = engine_config(tiny_llama, maxLoras=2).model_copy(
        update={"lora_modules": {"sql": adapters["sql"]}}
    )
    front = AsyncEngine(lambda: torch_engine(config))
    front.start()
    await front.wait_loaded()
    yield front
    await front.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_public_app(engine, PublicOptions("tiny", internal_token=TOKEN))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        yield client


def completion(model: str) -> dict[str, object]:
    return {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


async def text_of(client: httpx.AsyncClient, model: str) -> str:
    answer = await client.post("/v1/completions", json=completion(model))
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "tiny"
    return str(answer.json()["choices"][0]["text"])


async def test_the_model_field_picks_the_adapter(client: httpx.AsyncClient) -> None:
    assert await text_of(client, "sql") != await text_of(client, "tiny")


async def test_models_lists_the_base_and_its_adapters(
    client: httpx.AsyncClient, adapters: dict[str, Path]
) -> None:
    cards = (await client.get("/v1/models")).json()["data"]
    assert [(card["id"], card["parent"]) for card in cards] == [("tiny", None), ("sql", "tiny")]
    assert cards[1]["root"] == str(adapters["sql"])


async def test_an_unknown_adapter_is_a_404_in_the_envelope(client: httpx.AsyncClient) -> None:
    answer = await client.post("/v1/completions", json=completion("nobody"))
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["param"] == "model" and "'sql'" in error["message"]


async def test_runtime_load_and_unload(client: httpx.AsyncClient, adapters: dict[str, Path]) -> None:
    body = {"lora_name": "poet", "lora_path": str(adapters["poet"])}
    assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 401
    loaded = await client.post("/v1/load_lora_adapter", json=body, headers=AUTH)
    assert loaded.status_code == 200 and "poet" in loaded.text
    assert (
        await client.post("/v1/load_lora_adapter", json=body, headers=AUTH)
    ).status_code == 200  # again: no-op
    poem = await text_of(client, "poet")
    assert poem not in (await text_of(client, "sql"), await text_of(client, "tiny"))
    unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "poet"}, headers=AUTH)
    assert unloaded.status_code == 200
    assert (await client.post("/v1/completions", json=completion("poet"))).status_code == 404
    again = await client.post("/v1/unload_lora_adapter", json={"lora_name": "poet"}, headers=AUTH)
    assert again.status_code == 404 and again.json()["error"]["param"] == "model"


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"lora_name": "x", "lora_path": "/nonexistent"}, 400, "adapter_config.json"),
        ({"lora_name": "tiny", "lora_path": "/nonexistent"}, 400, "taken"),
        ({"lora_name": "bad name", "lora_path": "/x"}, 400, "lora_name"),
        ({"lora_path": "/x"}, 400, "lora_name"),
    ],
    ids=["no-adapter-there", "base-name", "bad-name", "no-name"],
)
async def test_load_refusals(
    client: httpx.AsyncClient, body: dict[str, str], status: int, words: str
) -> None:
    answer = await client.post("/v1/load_lora_adapter", json=body, headers=AUTH)
    assert answer.status_code == status
    assert words in answer.json()["error"]["message"] + str(answer.json()["error"]["param"])


async def test_lora_requests_info_and_the_load_report(client: httpx.AsyncClient, engine: AsyncEngine) -> None:
    await text_of(client, "sql")
    metrics = (await client.get("/metrics")).text
    [line] = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert (
        'max_lora="2"' in line and 'running_lora_adapters=""' in line and 'waiting_lora_adapters=""' in line
    )
    internal = build_internal_app(engine, TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=internal), base_url="http://w") as peer:
        load = (await peer.get(INTERNAL_PATHS.load, headers=AUTH)).json()
    assert load["max_loras"] == 2 and load["lora_adapters"] == ["sql"]


async def test_the_runtime_routes_need_a_token_to_exist(
    engine: AsyncEngine, adapters: dict[str, Path]
) -> None:
    app = build_public_app(engine, PublicOptions("tiny"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        body = {"lora_name": "poet", "lora_path": str(adapters["poet"])}
        answer = await client.post("/v1/load_lora_adapter", json=body, headers={TOKEN_HEADER: ""})
    assert answer.status_code == 403
