"""Where the gateway prepares a prompt for routing by tokens: the tokenizer's first load never runs on
the event loop (it reads the model folder, most of a second), and once loaded, a body under
``inline_prepare_bytes`` is tokenized inline rather than waiting for the niced prompt threads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway

from herd.api.crd import KVCacheAwareRouting, LeastRequestRouting
from herd.api.prompt import PromptRenderer


class ThreadNames:
    """Wraps a callable to record the name of the thread each call runs on."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.names: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.names.append(threading.current_thread().name)
        return self.call(*args, **kwargs)


async def test_first_load_off_the_loop_then_small_bodies_inline(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads = ThreadNames(PromptRenderer.from_pretrained)
    config = {"model_path": tiny_llama, "max_model_len": 4096}
    monkeypatch.setattr(PromptRenderer, "from_pretrained", loads)
    routing = KVCacheAwareRouting(strategy="kv_cache_aware")
    cluster = FakeCluster([FakeWorker("w0")])
    # Between the old threshold (2 KiB) and GATEWAY_INLINE_BYTES, like issue 14's ~550-token prompts.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 500}], "max_tokens": 2}
    async with running_gateway(cluster, routing=routing, model_config=config) as (
        app,
        client,
    ):
        first = await client.post("/v1/chat/completions", json=body)
        renderer = app.state.registry.models[MODEL].renderer
        encodes = renderer.encode = ThreadNames(renderer.encode)
        second = await client.post("/v1/chat/completions", json=body)
    assert (first.status_code, second.status_code) == (200, 200)
    assert [name.startswith("herd-prepare") for name in loads.names] == [True]
    assert encodes.names == [threading.main_thread().name]


@pytest.mark.parametrize(
    ("headers", "is_tokenized"),
    [
        ({}, False),  # least_request routes by load alone
        ({"x-slo-ttft-ms": "2000"}, True),  # the SLO choice needs the prompt's length
        ({"x-slo-tpot-ms": "50"}, True),
    ],
)
async def test_a_load_only_strategy_tokenizes_the_requests_with_latency_targets(
    tiny_llama: Path, headers: dict[str, str], is_tokenized: bool
) -> None:
    config = {"model_path": tiny_llama, "max_model_len": 4096}
    cluster = FakeCluster([FakeWorker("w0")])
    body = {"model": MODEL, "prompt": "hello " * 40, "max_tokens": 2}
    async with running_gateway(
        cluster, routing=LeastRequestRouting(strategy="least_request"), model_config=config
    ) as (app, client):
        response = await client.post("/v1/completions", json=body, headers=headers)
        served = app.state.registry.models[MODEL]
        assert response.status_code == 200
        assert served.has_renderer is is_tokenized
