"""The sidecar's internal port over a vLLM answered by ``httpx.MockTransport`` (its recorded
/metrics and model list): the token, info and load once vLLM is learned, KV events and snapshot, the
status stream as a herd worker serves it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from support.asgi_stream import StreamingASGITransport

from herd.api.errors import HttpError
from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER, TokenizerFiles, WorkerStatus
from herd.sidecar._internal import build_internal_app
from herd.sidecar._kv_state import KVState
from herd.sidecar._vllm import VLLMView, model_layout
from herd.sidecar._wire import BlockStored

DATA = Path(__file__).parent / "data"
TOKEN = "t"
CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
          "vocab_size": 49152, "torch_dtype": "float32"}  # fmt: skip


def _vllm(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/metrics":
        return httpx.Response(200, text=(DATA / "vllm_metrics.txt").read_text())
    models = {"data": [{"id": "smollm2", "max_model_len": 2048}]}
    return httpx.Response(200, json=models)


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, VLLMView, KVState]]:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    kv = KVState("smollm2", 32)
    async with httpx.AsyncClient(base_url="http://127.0.0.1:1", transport=httpx.MockTransport(_vllm)) as vllm:
        view = VLLMView(vllm, served_name="smollm2", role="unified", layout=model_layout(tmp_path))
        files = TokenizerFiles(files={"tokenizer.json": "{}"})
        is_ready = lambda: view.is_learned and not view.is_draining  # noqa: E731
        app = build_internal_app(TOKEN, kv, lambda: view.info(kv.epoch), view.load, files, is_ready)
        transport = StreamingASGITransport(app)
        async with httpx.AsyncClient(
            base_url="http://sidecar", transport=transport, headers={TOKEN_HEADER: TOKEN}
        ) as client:
            yield client, view, kv


async def test_every_route_wants_the_token(parts: tuple[httpx.AsyncClient, VLLMView, KVState]) -> None:
    client, _, _ = parts
    for path in (
        INTERNAL_PATHS.info,
        INTERNAL_PATHS.kv_snapshot,
        INTERNAL_PATHS.tokenizer,
        INTERNAL_PATHS.status,
    ):
        response = await client.get(path, headers={TOKEN_HEADER: "wrong"})
        assert response.status_code == 401 and TOKEN_HEADER in response.json()["error"]["message"]


async def test_info_and_load_once_vllm_is_learned(parts: tuple[httpx.AsyncClient, VLLMView, KVState]) -> None:
    client, view, kv = parts
    for path in (INTERNAL_PATHS.info, INTERNAL_PATHS.load):
        response = await client.get(path)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
    await view.learn()
    info = (await client.get(INTERNAL_PATHS.info)).json()
    assert info == {
        "model": "smollm2", "role": "unified", "block_size": 32, "max_model_len": 2048, "epoch": kv.epoch,
        "dtype": "float32", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "embedding_size": None, "is_normalized": False, "is_matryoshka": False, "matryoshka_dimensions": None,
    }  # fmt: skip
    load = (await client.get(INTERNAL_PATHS.load)).json()
    assert (load["num_total_blocks"], load["num_free_blocks"], load["is_draining"]) == (1456, 1456, False)
    assert (await client.get(INTERNAL_PATHS.tokenizer)).json() == {"files": {"tokenizer.json": "{}"}}


async def test_kv_events_and_snapshot(parts: tuple[httpx.AsyncClient, VLLMView, KVState]) -> None:
    client, _, kv = parts
    kv.apply(
        [BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=list(range(32)), block_size=32)]
    )
    events = (await client.get(INTERNAL_PATHS.kv_events, params={"after": -1})).json()
    snapshot = (await client.get(INTERNAL_PATHS.kv_snapshot)).json()
    assert events["epoch"] == snapshot["epoch"] == kv.epoch
    assert [event["seq"] for event in events["events"]] == [1] and snapshot["seq"] == 1
    assert (
        events["events"][0]["block_hashes"] == snapshot["block_hashes"] and len(snapshot["block_hashes"]) == 1
    )
    assert (await client.get(INTERNAL_PATHS.kv_events, params={"after": 1, "wait": 0.05})).json()[
        "events"
    ] == []


def _stored(block_hash: int) -> BlockStored:
    tokens = list(range(32 * block_hash, 32 * block_hash + 32))
    return BlockStored(block_hashes=[block_hash], parent_block_hash=None, token_ids=tokens, block_size=32)


async def test_the_status_stream_carries_readiness_load_and_kv_events_until_the_drain(
    parts: tuple[httpx.AsyncClient, VLLMView, KVState],
) -> None:
    client, view, kv = parts
    params = {"interval": 0.01, "heartbeat": 30.0}  # no line but for a change
    assert (await client.get(INTERNAL_PATHS.status, params=params)).status_code == 503  # vLLM not learned
    await view.learn()
    kv.apply([_stored(1)])
    statuses: list[WorkerStatus] = []
    async with client.stream("GET", INTERNAL_PATHS.status, params=params) as response:
        async for line in response.aiter_lines():
            statuses.append(WorkerStatus.model_validate_json(line))
            if len(statuses) == 1:
                kv.apply([_stored(2)])
            elif len(statuses) == 2:
                view.is_draining = True
    first, second, last = statuses
    assert first.is_ready and first.snapshot is not None and first.snapshot.seq == 1 and not first.events
    assert first.epoch == kv.epoch and first.load.num_total_blocks == 1456
    assert [event.seq for event in second.events] == [2] and second.snapshot is None
    assert not last.is_ready and last.load.is_draining  # the last line: the stream ended after it


async def test_a_load_vllm_reports_unreadably_is_a_503_that_names_the_metric(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    running = 'vllm:num_requests_running{engine="0",model_name="smollm2"} 0.0'
    metrics = (DATA / "vllm_metrics.txt").read_text().replace(running, running.replace("0.0", "NaN"))

    def vllm(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=metrics) if request.url.path == "/metrics" else _vllm(request)

    async with httpx.AsyncClient(
        base_url="http://127.0.0.1:1", transport=httpx.MockTransport(vllm)
    ) as client:
        view = VLLMView(client, served_name="smollm2", role="unified", layout=model_layout(tmp_path))
        await view.learn()  # the cache geometry is readable
        with pytest.raises(HttpError) as raised:
            await view.load()
    assert raised.value.status == 503 and "num_requests_running" in str(raised.value)
