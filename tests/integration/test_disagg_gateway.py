"""The orchestrator's two-phase flow over real in-process workers: 2 prefill, 1 decode, 1 unified.

Checks that long prompts go through a prefill worker and come back from the decode worker with the
unified worker's greedy text, that short prompts skip the prefill pool, that a prefill worker
failing before the handoff is replaced by another one or by a local prefill, and that no KV block
stays held on any worker afterwards.
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
from support.disagg import TOKEN, HostDispatch, InProcessWorker, greedy_chat, start_worker
from support.gateway_fakes import wait_for
from support.upstream_fakes import HttpxUpstream
from support.worker_server import sse_data

from herd.api.crd import KVCacheAwareRouting
from herd.api.prompt import PromptRenderer
from herd.api.protocol import INTERNAL_PATHS, WORKER_HEADER
from herd.orchestrator.app import AppSettings, build_app
from herd.orchestrator.discovery import ModelConfig, StaticSource
from herd.orchestrator.registry import Registry, RegistrySettings

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

CHAT = "/v1/chat/completions"
THRESHOLD = 64
WORDS = ["red", "fox", "jumps", "over", "lazy", "dogs", "in", "green", "fields", "all", "day", "long"]
SENT = "herd_kv_transfer_blocks_total"


@dataclass
class Cluster:
    dispatch: HostDispatch
    workers: dict[str, InProcessWorker]
    gateway: httpx.AsyncClient
    registry: Registry

    async def wait_all_admitted(self) -> None:
        """Every served worker healthy in the registry (an ejected one is re-admitted by the poller,
        every 0.05 s)."""
        registry = self.registry
        await wait_for(
            lambda: len(registry.workers) == 3 and all(w.is_healthy for w in registry.workers.values())
        )

    async def sent_blocks(self, worker_id: str) -> float:
        return await self.workers[worker_id].metric(SENT, direction="sent")

    async def assert_no_block_held(self) -> None:
        """Every worker's pool is wholly free again (bounded wait: loads trail commands by a turn)."""
        for worker in self.workers.values():
            for _ in range(50):
                load = await worker.load()
                if load["num_free_blocks"] == load["num_total_blocks"]:
                    break
                await asyncio.sleep(0.05)
            assert load["num_free_blocks"] == load["num_total_blocks"], worker.id


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tiny_llama: Path) -> AsyncIterator[Cluster]:
    dispatch = HostDispatch()
    http = httpx.AsyncClient(transport=dispatch, timeout=60)
    roles = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "unified-0": "unified"}
    workers = {wid: await start_worker(tiny_llama, wid, role, dispatch, http) for wid, role in roles.items()}  # type: ignore[arg-type]
    model = ModelConfig(
        "tiny",
        KVCacheAwareRouting(strategy="kv_cache_aware"),
        block_size=16,
        max_model_len=512,
        model_path=tiny_llama,
        mode="disaggregated",
        prefill_threshold_tokens=THRESHOLD,
    )
    served = [worker.endpoint for worker in workers.values() if worker.role != "unified"]
    settings = AppSettings(internal_token=TOKEN, registry=RegistrySettings(poll_interval=0.05))
    app = build_app(
        StaticSource([model], served), settings=settings, http=http, upstream=HttpxUpstream(http, token=TOKEN)
    )
    async with app.router.lifespan_context(app):
        registry = app.state.registry
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://orchestrator", timeout=60
        ) as gateway:
            cluster = Cluster(dispatch, workers, gateway, registry)
            await cluster.wait_all_admitted()
            yield cluster
    for worker in workers.values():
        await worker.engine.stop()
    await http.aclose()


def chat(num_words: int, seed: int, **fields: Any) -> dict[str, Any]:
    rng = random.Random(seed)
    return greedy_chat(" ".join(rng.choice(WORDS) for _ in range(num_words)), **fields)


async def unified_text(cluster: Cluster, body: dict[str, Any]) -> str:
    worker = cluster.workers["unified-0"]
    response = await worker.http.post(worker.endpoint.url + CHAT, json=body)
    return str(response.json()["choices"][0]["message"]["content"])


async def total_sent(cluster: Cluster) -> float:
    return await cluster.sent_blocks("prefill-0") + await cluster.sent_blocks("prefill-1")


async def test_long_prompts_prefill_remotely_and_decode_streams_the_unified_text(cluster: Cluster) -> None:
    for seed in range(3):
        body = chat(80, seed, stream=True)
        before = await total_sent(cluster)
        response = await cluster.gateway.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        assert response.headers[WORKER_HEADER] == "decode-0"
        events = sse_data(response.text)
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
        assert text == await unified_text(cluster, {**body, "stream": False})
        assert await total_sent(cluster) > before
    await cluster.assert_no_block_held()


async def test_short_prompts_skip_the_prefill_pool(cluster: Cluster) -> None:
    body = chat(4, 100)
    before = await total_sent(cluster)
    response = await cluster.gateway.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == await unified_text(cluster, body)
    assert await total_sent(cluster) == before


def counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """Every call of ``PromptRenderer.<name>`` from now on, in any process part (the gateway's renderer
    and each worker's, threads included), by the thread that made it."""
    calls: list[str] = []
    original = getattr(PromptRenderer, name)

    def counting(self: PromptRenderer, *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PromptRenderer, name, counting)
    return calls


@pytest.mark.parametrize(("num_words", "is_remote"), [(80, True), (4, False)], ids=["remote", "local"])
async def test_a_disaggregated_request_is_rendered_and_tokenized_once(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, num_words: int, is_remote: bool
) -> None:
    """The gateway renders and tokenizes; the prefill and the decode worker run the ids it handed over."""
    body = chat(num_words, 400 + num_words, stream=True)
    renders, encodes = counted(monkeypatch, "render_chat"), counted(monkeypatch, "encode")
    before = await total_sent(cluster)
    response = await cluster.gateway.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert sse_data(response.text)[-1] == "[DONE]"
    assert (await total_sent(cluster) > before) == is_remote
    assert (len(renders), len(encodes)) == (1, 1)
    await cluster.assert_no_block_held()


@pytest.mark.parametrize(
    "dead", [("prefill-0",), ("prefill-0", "prefill-1")], ids=["one-prefill-dies", "every-prefill-dies"]
)
async def test_a_prefill_worker_failing_before_the_handoff_is_replaced(
    cluster: Cluster, dead: tuple[str, ...]
) -> None:
    await cluster.wait_all_admitted()  # an earlier case ejected prefill-0: it must be back first
    refused = {(f"{worker_id}.internal", INTERNAL_PATHS.prefill) for worker_id in dead}
    cluster.dispatch.refused |= refused
    try:
        sent = {worker_id: await cluster.sent_blocks(worker_id) for worker_id in ("prefill-0", "prefill-1")}
        body = chat(90, 200 + len(dead))
        num_refused = cluster.dispatch.num_refused
        response = await cluster.gateway.post(CHAT, json=body)
        assert cluster.dispatch.num_refused == num_refused + len(dead)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == await unified_text(cluster, body)
        assert await cluster.sent_blocks("prefill-0") == sent["prefill-0"]
        survivor_sent = await cluster.sent_blocks("prefill-1") > sent["prefill-1"]
        assert survivor_sent == (len(dead) == 1)
    finally:
        cluster.dispatch.refused -= refused
    await cluster.assert_no_block_held()


async def test_a_dead_decode_worker_is_an_error_and_the_prefill_lease_is_released(cluster: Cluster) -> None:
    cluster.dispatch.refused.add(("decode-0.public", None))
    try:
        response = await cluster.gateway.post(CHAT, json=chat(90, 300))
        assert response.status_code in (502, 503)
        assert "error" in response.json()
    finally:
        cluster.dispatch.refused.discard(("decode-0.public", None))
    await cluster.assert_no_block_held()
