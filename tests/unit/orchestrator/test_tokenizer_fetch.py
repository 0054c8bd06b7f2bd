"""A model without a local folder gets its tokenizer from its workers, and is served meanwhile.

The fake workers (``support.gateway_fakes``) also answer ``INTERNAL_PATHS.tokenizer`` here, with
the files of the tiny Llama checkpoint, behind a gate the test opens.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway, wait_for

from herd.api.crd import KVCacheAwareRouting, RoutingSpec
from herd.api.kv_hash import block_hashes
from herd.api.openai import ChatCompletionRequest
from herd.api.prompt import PromptRenderer, read_tokenizer_files
from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER, WORKER_HEADER, TokenizerFiles
from herd.orchestrator.app import AppSettings
from herd.orchestrator.discovery import StaticSource
from herd.orchestrator.registry import RegistrySettings
from herd.orchestrator.tokens import prompt_token_ids

CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a long story about a careful llama. " * 6}],
}
ROUTING = KVCacheAwareRouting(strategy="kv_cache_aware")
WITHIN_S = 30.0
"""Budget for background work (a tokenizer built off the loop): generous when loaded, free when quick."""
SETTINGS = AppSettings(internal_token="s3cret", registry=RegistrySettings(poll_interval=0.02, heartbeat=0.05))


@dataclass(eq=False)
class TokenizerCluster(FakeCluster):
    """Fake workers that also serve tokenizer files (``status`` 404: a worker without the route)."""

    files: dict[str, str] = field(default_factory=dict)
    status: int = 200
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    model_path: Path | None = None
    tokens_seen: list[str | None] = field(default_factory=list)

    @property
    def num_status_lines(self) -> int:
        return sum(worker.num_status_lines for worker in self.workers)

    def transport(self) -> httpx.MockTransport:
        workers = super().transport()

        async def handle(request: httpx.Request) -> httpx.Response:
            if request.url.path != INTERNAL_PATHS.tokenizer:
                return await workers.handle_async_request(request)
            self.tokens_seen.append(request.headers.get(TOKEN_HEADER))
            await self.gate.wait()
            if self.status != 200:
                return httpx.Response(self.status)
            return httpx.Response(200, content=TokenizerFiles(files=self.files).model_dump_json())

        return httpx.MockTransport(handle)

    def source(self, routing: RoutingSpec | None = None, **config: object) -> StaticSource:
        return super().source(routing, model_path=self.model_path, **config)


def cluster_for(tiny_llama: Path, **fields: Any) -> TokenizerCluster:
    files = read_tokenizer_files(tiny_llama)
    return TokenizerCluster([FakeWorker("w0"), FakeWorker("w1")], files=files, **fields)


def expected_hashes(tiny_llama: Path) -> list[int]:
    token_ids = prompt_token_ids(
        PromptRenderer.from_pretrained(tiny_llama), ChatCompletionRequest.model_validate(CHAT)
    )
    return block_hashes(token_ids, 16, model_id=MODEL)


async def more_polls(cluster: TokenizerCluster, num_rounds: int) -> None:
    """Wait for ``num_rounds`` more status lines from every worker (each offers the fetch again):
    counted, not slept, so a loaded machine cannot pass a "nothing more happens" check by reading less."""
    target = cluster.num_status_lines + num_rounds * len(cluster.workers)
    await wait_for(lambda: cluster.num_status_lines >= target, within=WITHIN_S)


async def chosen_workers(client: httpx.AsyncClient, num_requests: int) -> list[str]:
    responses = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(num_requests)]
    assert [response.status_code for response in responses] == [200] * num_requests
    return [response.headers[WORKER_HEADER] for response in responses]


async def test_requests_are_served_before_the_fetch_and_routed_by_cache_after(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = cluster_for(tiny_llama)
    cluster.workers[1].snapshot_blocks = expected_hashes(tiny_llama)
    async with running_gateway(cluster, routing=ROUTING, settings=SETTINGS) as (app, client):
        served = app.state.registry.models[MODEL]
        with caplog.at_level(logging.WARNING, logger="herd.orchestrator.gateway"):
            before = await chosen_workers(client, 20)
        assert served.wants_worker_tokenizer, "the fetch is held at the gate"
        cluster.gate.set()
        await wait_for(lambda: not served.wants_worker_tokenizer, within=WITHIN_S)
        hashes = expected_hashes(tiny_llama)
        await wait_for(lambda: served.kv_index.match(hashes) == {"w1": len(hashes)}, within=WITHIN_S)
        after = await chosen_workers(client, 4)
    # Token routing would send all 20 to w1; least in-flight breaks ties at random (all w1: p = 2**-20).
    assert "w0" in before, "no tokens: routed by load alone"
    assert after == ["w1"] * 4, "with tokens: the worker holding the prompt's blocks"
    assert [r.message for r in caplog.records].count(
        "routing without tokens (least in-flight) until the tokenizer is fetched"
    ) == 1
    assert cluster.tokens_seen == ["s3cret"], "one authenticated fetch per model"


async def test_the_fetched_tokenizer_hashes_as_the_local_one(tiny_llama: Path) -> None:
    cluster = cluster_for(tiny_llama)
    cluster.gate.set()
    async with running_gateway(cluster, routing=ROUTING, settings=SETTINGS) as (app, _):
        served = app.state.registry.models[MODEL]
        await wait_for(lambda: not served.wants_worker_tokenizer, within=WITHIN_S)
        token_ids = prompt_token_ids(served.renderer, ChatCompletionRequest.model_validate(CHAT))
    assert block_hashes(token_ids, 16, model_id=MODEL) == expected_hashes(tiny_llama)


async def test_a_worker_without_the_route_costs_bounded_retries_and_no_errors(tiny_llama: Path) -> None:
    cluster = cluster_for(tiny_llama, status=404)
    cluster.gate.set()
    async with running_gateway(cluster, routing=ROUTING, settings=SETTINGS) as (app, client):
        await wait_for(lambda: len(cluster.tokens_seen) >= 5, within=WITHIN_S)
        await more_polls(cluster, 10)  # no further fetch
        workers = await chosen_workers(client, 3)
        assert app.state.registry.models[MODEL].wants_worker_tokenizer
    assert len(cluster.tokens_seen) == 5 and len(workers) == 3


async def test_a_local_model_folder_wins_and_nothing_is_fetched(tiny_llama: Path) -> None:
    cluster = cluster_for(tiny_llama, model_path=tiny_llama)
    cluster.workers[0].snapshot_blocks = expected_hashes(tiny_llama)
    async with running_gateway(cluster, routing=ROUTING, settings=SETTINGS) as (_, client):
        workers = await chosen_workers(client, 3)
        await more_polls(cluster, 5)
    assert workers == ["w0"] * 3 and cluster.tokens_seen == []


async def test_a_restarted_source_worker_is_asked_again(tiny_llama: Path) -> None:
    cluster = TokenizerCluster([FakeWorker("w0")], files=read_tokenizer_files(tiny_llama))
    cluster.gate.set()
    async with running_gateway(cluster, routing=ROUTING, settings=SETTINGS) as (app, client):
        worker = app.state.registry.workers["w0"]
        await wait_for(lambda: not app.state.registry.models[MODEL].wants_worker_tokenizer, within=WITHIN_S)
        cluster.workers[0].is_up = False
        await wait_for(lambda: not worker.is_healthy)
        cluster.workers[0].is_up = True
        await wait_for(lambda: len(cluster.tokens_seen) == 2, within=WITHIN_S)
        workers = await chosen_workers(client, 2)
    assert workers == ["w0", "w0"]
