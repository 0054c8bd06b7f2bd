"""Disaggregation between real tiny-model workers in process: prefill, KV pull, decode.

Three engines: a prefill worker, a decode worker (its KV pulls reach the prefill worker's internal
app through an in-process transport) and a unified worker as the reference for greedy outputs.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families
from support.worker_server import engine_config, sse_data

from herd.api.kv_hash import block_hashes
from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER
from herd.worker.async_engine import AsyncEngine
from herd.worker.engine import LLMEngine
from herd.worker.server import PublicOptions, build_internal_app, build_public_app
from herd.worker.server._disagg_setup import attach_disaggregation

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

TOKEN = "disagg-token"
CHAT = "/v1/chat/completions"
BLOCK = 16
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "seven",
    "dogs",
    "ran",
    "far",
    "away",
    "under",
    "bright",
    "blue",
    "skies",
    "near",
    "old",
    "towns",
]


@dataclass
class Worker:
    engine: AsyncEngine
    public: httpx.AsyncClient
    internal: httpx.AsyncClient

    async def free_blocks(self) -> int:
        return int((await self.internal.get(INTERNAL_PATHS.load)).json()["num_free_blocks"])

    async def total_blocks(self) -> int:
        return int((await self.internal.get(INTERNAL_PATHS.load)).json()["num_total_blocks"])

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
        text = (await self.public.get("/metrics")).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    async def received_blocks(self) -> float:
        return await self.metric("herd_kv_transfer_blocks_total", direction="received")

    async def settled_free_blocks(self, expected: int | None = None) -> int:
        """Free blocks once they reach ``expected`` (default: all), or after a bounded wait.

        The load report trails the engine thread's commands by one loop turn.
        """
        wanted = await self.total_blocks() if expected is None else expected
        for _ in range(50):
            if (free := await self.free_blocks()) == wanted:
                return free
            await asyncio.sleep(0.05)
        return await self.free_blocks()


async def _worker(model: Path, peer: httpx.AsyncClient | None) -> tuple[AsyncEngine, Any, Any]:
    config = engine_config(model, maxModelLen=512, kvCache={"blockSize": BLOCK, "memoryGiB": 0.02})
    engine = AsyncEngine(lambda: LLMEngine(config))
    engine.start()
    await engine.wait_loaded()
    public = build_public_app(engine, PublicOptions("tiny"))
    disagg = attach_disaggregation(public, engine, TOKEN, http=peer)
    return engine, public, build_internal_app(engine, TOKEN, routers=[disagg.router])


def _clients(public: Any, internal: Any, host: str) -> tuple[httpx.AsyncClient, httpx.AsyncClient]:
    return (
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=public), base_url=f"http://{host}:8000", timeout=60
        ),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=internal),
            base_url=f"http://{host}:9000",
            headers={TOKEN_HEADER: TOKEN},
            timeout=60,
        ),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers(tiny_llama: Path) -> AsyncIterator[dict[str, Worker]]:
    engine, public, internal = await _worker(tiny_llama, None)
    prefill = Worker(engine, *_clients(public, internal, "prefill"))
    peer = httpx.AsyncClient(transport=httpx.ASGITransport(app=internal), timeout=60)
    built = {"prefill": prefill}
    for role, to_peer in (("decode", peer), ("unified", None)):
        engine, public, internal = await _worker(tiny_llama, to_peer)
        built[role] = Worker(engine, *_clients(public, internal, role))
    yield built
    for worker in built.values():
        await worker.public.aclose()
        await worker.internal.aclose()
        await worker.engine.stop()
    await peer.aclose()


def chat(text: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }


def sentence(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


async def prefill(worker: Worker, body: dict[str, Any], **params: Any) -> dict[str, Any]:
    response = await worker.internal.post(
        INTERNAL_PATHS.prefill, json={**body, "kv_transfer_params": {"do_remote_decode": True, **params}}
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def disaggregated(workers: dict[str, Worker], body: dict[str, Any]) -> dict[str, Any]:
    params = await prefill(workers["prefill"], body)
    response = await workers["decode"].public.post(CHAT, json={**body, "kv_transfer_params": params})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def unified_text(workers: dict[str, Worker], body: dict[str, Any]) -> str:
    response = await workers["unified"].public.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


async def num_prompt_blocks(worker: Worker, body: dict[str, Any]) -> int:
    """Blocks the decode side can take: the full blocks before the one holding the last prompt token."""
    tokens = (await worker.public.post("/tokenize", json={"messages": body["messages"]})).json()["tokens"]
    return (len(tokens) - 1) // BLOCK


async def num_held_blocks(worker: Worker, body: dict[str, Any]) -> int:
    """How many of the prompt's pullable blocks the worker's prefix cache holds now."""
    tokens = (await worker.public.post("/tokenize", json={"messages": body["messages"]})).json()["tokens"]
    held = set((await worker.internal.get(INTERNAL_PATHS.kv_snapshot)).json()["block_hashes"])
    hashes = block_hashes(tokens, BLOCK, model_id="tiny")[: (len(tokens) - 1) // BLOCK]
    return sum(1 for block_hash in hashes if block_hash in held)


async def test_greedy_outputs_through_prefill_and_decode_equal_a_unified_worker(
    workers: dict[str, Worker],
) -> None:
    rng = random.Random(5)
    decode = workers["decode"]
    for number in range(20):
        shared = sentence(rng, 30 + number)
        body = chat(shared + " " + sentence(rng, 20 + 3 * number))
        if number % 2:  # the decode worker holds the shared prefix already: only the rest moves
            await decode.public.post(CHAT, json=chat(shared, max_tokens=1))
        num_cached = await num_held_blocks(decode, body)
        assert num_cached > 0 or not number % 2
        before = await decode.received_blocks()
        result = await disaggregated(workers, body)
        moved = await decode.received_blocks() - before
        assert result["choices"][0]["message"]["content"] == await unified_text(workers, body), number
        assert moved == await num_prompt_blocks(decode, body) - num_cached, number
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] >= (moved + num_cached) * BLOCK
    assert await workers["prefill"].settled_free_blocks() == await workers["prefill"].total_blocks()
    assert await decode.settled_free_blocks() == await decode.total_blocks()


async def test_decode_streams_the_same_tokens(workers: dict[str, Worker]) -> None:
    body = chat(sentence(random.Random(11), 70))
    params = await prefill(workers["prefill"], body)
    response = await workers["decode"].public.post(
        CHAT, json={**body, "stream": True, "kv_transfer_params": params}
    )
    assert response.status_code == 200, response.text
    events = sse_data(response.text)
    assert events[-1] == "[DONE]"
    text = "".join(
        event["choices"][0]["delta"].get("content") or "" for event in events[:-1] if event["choices"]
    )
    assert text == await unified_text(workers, body)


async def test_prefill_holds_blocks_until_the_decode_side_releases_them(workers: dict[str, Worker]) -> None:
    worker = workers["prefill"]
    body = chat(sentence(random.Random(12), 60))
    params = await prefill(worker, body)
    assert len(params["remote_block_ids"]) == len(params["remote_block_hashes"]) > 0
    assert params["first_token_ids"] and params["remote_host"] == "prefill" and params["remote_port"] == 9000
    held = await worker.total_blocks() - len(params["remote_block_ids"])
    assert await worker.settled_free_blocks(held) == held
    released = await worker.internal.post(
        INTERNAL_PATHS.kv_release, json={"remote_request_id": params["remote_request_id"]}
    )
    assert released.json() == {"num_released_blocks": len(params["remote_block_ids"])}
    assert await worker.settled_free_blocks() == await worker.total_blocks()


async def test_an_expired_lease_frees_its_blocks_and_is_counted(workers: dict[str, Worker]) -> None:
    worker = workers["prefill"]
    expired_before = await worker.metric("herd_kv_leases_expired_total")
    params = await prefill(worker, chat(sentence(random.Random(13), 60)), lease_seconds=0.5)
    held = await worker.total_blocks() - len(params["remote_block_ids"])
    assert await worker.settled_free_blocks(held) == held
    await asyncio.sleep(1.0)
    assert await worker.settled_free_blocks() == await worker.total_blocks()
    assert await worker.metric("herd_kv_leases_expired_total") == expired_before + 1
    gone = await worker.internal.post(
        INTERNAL_PATHS.kv_blocks,
        json={
            "remote_request_id": params["remote_request_id"],
            "block_hashes": params["remote_block_hashes"][:1],
            "layout": _layout(workers["decode"]),
        },
    )
    assert gone.status_code == 404 and "prefill the request locally" in gone.json()["error"]["message"]


async def test_decode_prefills_locally_when_the_lease_is_gone(workers: dict[str, Worker]) -> None:
    body = chat(sentence(random.Random(14), 80))
    params = await prefill(workers["prefill"], body)
    await workers["prefill"].internal.post(
        INTERNAL_PATHS.kv_release, json={"remote_request_id": params["remote_request_id"]}
    )
    before = await workers["decode"].received_blocks()
    response = await workers["decode"].public.post(CHAT, json={**body, "kv_transfer_params": params})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == await unified_text(workers, body)
    assert await workers["decode"].received_blocks() == before
    for worker in workers.values():
        assert await worker.settled_free_blocks() == await worker.total_blocks()


def _layout(worker: Worker) -> dict[str, Any]:
    info = worker.engine.info
    return {
        name: getattr(info, name)
        for name in ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_size", 32), ("dtype", "bfloat16"), ("num_layers", 3), ("head_dim", 64), ("model", "other")],
    ids=["block-size", "dtype", "layers", "head-dim", "model"],
)
async def test_the_prefill_side_refuses_a_foreign_layout(
    workers: dict[str, Worker], field: str, value: Any
) -> None:
    params = await prefill(workers["prefill"], chat(sentence(random.Random(15), 40)), lease_seconds=1)
    response = await workers["prefill"].internal.post(
        INTERNAL_PATHS.kv_blocks,
        json={
            "remote_request_id": params["remote_request_id"],
            "block_hashes": params["remote_block_hashes"],
            "layout": {**_layout(workers["decode"]), field: value},
        },
    )
    assert response.status_code == 409
    assert field in response.json()["error"]["message"]
    await workers["prefill"].internal.post(
        INTERNAL_PATHS.kv_release, json={"remote_request_id": params["remote_request_id"]}
    )


async def test_the_decode_side_refuses_blocks_of_another_prompt(workers: dict[str, Worker]) -> None:
    body = chat(sentence(random.Random(16), 60))
    params = await prefill(workers["prefill"], body)
    params["remote_block_hashes"] = [block_hash ^ 1 for block_hash in params["remote_block_hashes"]]
    response = await workers["decode"].public.post(CHAT, json={**body, "kv_transfer_params": params})
    assert response.status_code == 409
    assert "different models" in response.json()["error"]["message"]
    assert await workers["prefill"].settled_free_blocks() == await workers["prefill"].total_blocks()
