"""``/v1/embeddings`` through the gateway over fake workers: validated, routed by load, never
tokenized for a prefix cache nor prefilled apart."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import FastAPI
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway, wait_for

from herd.api.crd import KVCacheAwareRouting
from herd.api.protocol import WORKER_HEADER, LoadReport

EMBED = {"model": MODEL, "input": ["the quick brown fox", "jumps over"], "encoding_format": "float"}


async def test_an_embedding_goes_to_the_least_loaded_worker_as_sent(tiny_llama: Path) -> None:
    busy = FakeWorker("w0", load=LoadReport(num_running=4, num_waiting=3, num_waiting_prefill_tokens=900))
    idle = FakeWorker("w1")
    cluster = FakeCluster([busy, idle])
    routing = KVCacheAwareRouting(strategy="kv_cache_aware")
    async with running_gateway(cluster, routing=routing, model_config={"model_path": tiny_llama}) as (
        app,
        client,
    ):
        await _wait_for_load(app, "w0")
        answers = [await client.post("/v1/embeddings", json=EMBED) for _ in range(3)]
        served = app.state.registry.models[MODEL]
    assert [answer.status_code for answer in answers] == [200, 200, 200]
    assert {answer.headers[WORKER_HEADER] for answer in answers} == {"w1"}
    assert (busy.num_requests, idle.num_requests) == (0, 3)
    assert not any(served.kv_index.held_blocks().values())  # no blocks expected: nothing caches them


async def _wait_for_load(app: FastAPI, worker_id: str) -> None:
    registry = app.state.registry
    await wait_for(lambda: registry.workers[worker_id].report.num_waiting_prefill_tokens > 0)


async def test_a_disaggregated_model_embeds_on_its_serving_pool_without_a_prefill(tiny_llama: Path) -> None:
    prefill, decode = FakeWorker("p0", role="prefill"), FakeWorker("d0", role="decode")
    config = {"model_path": tiny_llama, "mode": "disaggregated", "prefill_threshold_tokens": 1}
    async with running_gateway(FakeCluster([prefill, decode]), model_config=config) as (_, client):
        answer = await client.post("/v1/embeddings", json=EMBED)
    assert answer.status_code == 200 and answer.headers[WORKER_HEADER] == "d0"
    assert (prefill.prefills, decode.num_requests) == ([], 1)


async def test_a_bad_embedding_request_is_refused_naming_the_field() -> None:
    worker = FakeWorker("w0")
    async with running_gateway(FakeCluster([worker])) as (_, client):
        empty = await client.post("/v1/embeddings", json={**EMBED, "input": []})
        bad_format = await client.post("/v1/embeddings", json={**EMBED, "encoding_format": "hex"})
        schema = await client.get("/openapi.json")
    assert [empty.status_code, bad_format.status_code] == [400, 400]
    assert empty.json()["error"]["param"] == "input"
    assert bad_format.json()["error"]["param"] == "encoding_format"
    assert worker.num_requests == 0
    assert "EmbeddingRequest" in json.dumps(schema.json()["paths"]["/v1/embeddings"])
