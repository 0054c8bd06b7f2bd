"""The routes peer routers call on a worker, in process on the simulated engine (a virtual clock)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support.worker_server import engine_config

from herd.api.kv_hash import hash_block, root_hash
from herd.worker.async_engine import AsyncEngine
from herd.worker.block_manager import BlockManager
from herd.worker.server import PublicOptions, build_public_app
from herd.worker.simulated_runner import simulated_engine

PROMPT = "Peer routers poll loads and settings. " * 8
PEER_ROUTES = [
    ("GET", "/get_load"),
    ("GET", "/v1/loads"),
    ("GET", "/server_info"),
    ("GET", "/get_server_info"),
    ("GET", "/model_info"),
    ("GET", "/get_model_info"),
    ("POST", "/flush_cache"),
    ("POST", "/v1/chat/completions/render"),
    ("POST", "/v1/completions/render"),
]
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest_asyncio.fixture
async def engine(tiny_llama: Path) -> AsyncIterator[AsyncEngine]:
    config = engine_config(tiny_llama)
    front = AsyncEngine(lambda: simulated_engine(config, num_blocks=64))
    front.start()
    await front.wait_loaded()
    yield front
    await front.stop()


@pytest_asyncio.fixture
async def client(engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_public_app(engine, PublicOptions("tiny"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        yield client


async def _complete(client: httpx.AsyncClient) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _cached_tokens(answer: dict[str, Any]) -> int:
    cached: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


async def test_loads_are_the_engines_own_figures(
    client: httpx.AsyncClient, engine: AsyncEngine, tiny_llama: Path
) -> None:
    await _complete(client)
    second = await _complete(client)
    load, stats, block_size = engine.load_report(), engine.stats, engine.info.block_size
    sglang = (await client.get("/get_load")).json()
    gateway = (await client.get("/v1/loads", params={"include": "core,disagg,queues,memory"})).json()
    rank = gateway["loads"][0]
    held = (load.num_total_blocks - load.num_free_blocks) * block_size
    assert sglang == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": held}]
    assert gateway["dp_rank_count"] == 1
    assert rank["max_total_num_tokens"] == 64 * block_size
    assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["num_used_tokens"]) == (0, 0, held)
    assert rank["cache_hit_rate"] == pytest.approx(stats.prefix_cache_hits / stats.prefix_cache_queries)
    assert _cached_tokens(second) > 0 and rank["cache_hit_rate"] > 0
    # A peer's lease waits for its step in progress; routing sizes that step by this budget, and by
    # a decode step's time (each completion decoded 3 tokens after its prefill).
    assert load.max_batch_tokens == engine_config(tiny_llama).engine.max_batch_tokens > 0
    assert load.decode_step_s is not None and 0 < load.decode_step_s < 60


async def test_server_and_model_info_are_the_engines_settings(
    client: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    info = engine.info
    for path in ("/server_info", "/get_server_info"):
        server = (await client.get(path)).json()
        assert server["served_model_name"] == "tiny"
        assert (server["context_length"], server["page_size"]) == (info.max_model_len, info.block_size)
        assert server["max_total_num_tokens"] == 64 * info.block_size
        assert (server["dp_size"], server["disaggregation_mode"]) == (1, "null")
    for path in ("/model_info", "/get_model_info"):
        assert (await client.get(path)).json() == {
            "model_path": "tiny",
            "tokenizer_path": "tiny",
            "is_generation": True,
        }


async def test_flush_cache_forgets_the_prefix_cache(client: httpx.AsyncClient, engine: AsyncEngine) -> None:
    assert _cached_tokens(await _complete(client)) == 0
    assert _cached_tokens(await _complete(client)) > 0
    seq = engine.num_kv_events
    response = await client.post("/flush_cache")
    assert response.status_code == 200, response.text
    assert (await engine.kv_snapshot()).block_hashes == []
    assert [event.kind for event in await engine.kv_events_after(seq - 1)][-1] == "cleared"
    assert _cached_tokens(await _complete(client)) == 0


async def test_flush_cache_refuses_while_a_block_is_held(
    client: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    await _complete(client)
    cached = (await engine.kv_snapshot()).block_hashes
    held = await engine.call(lambda core: core.block_manager.hold_prefix(cached[:1]))  # type: ignore[attr-defined]
    response = await client.post("/flush_cache")
    assert response.status_code == 409
    assert "flush it again when the worker is idle" in response.json()["error"]["message"]
    assert (await engine.kv_snapshot()).block_hashes == cached
    await engine.call(lambda core: core.block_manager.release(held))  # type: ignore[attr-defined]
    assert (await client.post("/flush_cache")).status_code == 200


async def test_render_gives_the_token_ids_the_worker_would_run(client: httpx.AsyncClient) -> None:
    chat = await client.post("/v1/chat/completions/render", json={"model": "tiny", "messages": MESSAGES})
    assert chat.status_code == 200, chat.text
    tokenized = (await client.post("/tokenize", json={"messages": MESSAGES})).json()
    assert chat.json()["token_ids"] == tokenized["tokens"]
    assert chat.json()["model"] == "tiny"
    prompts = {"model": "tiny", "prompt": [PROMPT, "second"]}
    completions = (await client.post("/v1/completions/render", json=prompts)).json()
    expected = [
        (await client.post("/tokenize", json={"prompt": text})).json()["tokens"] for text in prompts["prompt"]
    ]
    assert [rendered["token_ids"] for rendered in completions] == expected


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"model": "other", "messages": MESSAGES}, 404, "is not served here"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "word " * 600}]},
            400,
            "shorten the prompt",
        ),
        ({"model": "tiny"}, 400, "messages"),
    ],
    ids=["another-model", "longer-than-the-context", "no-messages"],
)
async def test_render_refuses_what_generation_refuses(
    client: httpx.AsyncClient, body: dict[str, Any], status: int, words: str
) -> None:
    response = await client.post("/v1/chat/completions/render", json=body)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"]


@pytest.mark.parametrize(("method", "path"), PEER_ROUTES, ids=[path for _, path in PEER_ROUTES])
async def test_a_loading_worker_answers_every_peer_route_503(
    tiny_llama: Path, method: str, path: str
) -> None:
    app = build_public_app(
        AsyncEngine(lambda: simulated_engine(engine_config(tiny_llama))), PublicOptions("tiny")
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as client:
        response = await client.request(
            method, path, json={"model": "tiny", "prompt": "x", "messages": MESSAGES}
        )
    assert response.status_code == 503
    assert "still loading" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("held", "can_reset"), [(False, True), (True, False)], ids=["idle-pool", "a-block-held-by-a-lease"]
)
def test_only_an_idle_pool_resets_its_prefix_cache(held: bool, can_reset: bool) -> None:
    blocks = BlockManager(num_blocks=4, block_size=2)
    block_hash = hash_block(root_hash("unit-model", None), [1, 2])
    block_id = blocks.import_block(block_hash, [1, 2])
    assert block_id is not None
    blocks.release([block_id])
    if held:
        blocks.hold_prefix([block_hash])
    assert blocks.can_reset_prefix_cache() is can_reset
    if can_reset:
        blocks.events.drain()
        blocks.reset_prefix_cache()
        assert blocks.cached_hashes() == []
        assert [event.kind for event in blocks.events.drain()] == ["cleared"]


async def test_the_openapi_document_resolves_the_peer_routes_answers(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    for method, path in PEER_ROUTES:
        operation = document["paths"][path][method.lower()]
        assert method == "GET" or "requestBody" in operation, f"{path} documents no body"
    assert document["paths"]["/flush_cache"]["post"]["requestBody"]["required"] is False
    refs = set(re.findall(r"#/components/schemas/(\w+)", json.dumps(document)))
    assert {"WorkerLoads", "ServerInfo", "ChatCompletionRequest"} <= refs
    assert refs <= set(document["components"]["schemas"])
