"""A multi-MiB prompt is rendered and tokenized off the gateway's event loop: while the tokenizer
works on it, GET /v1/models and /health are answered (an ordering, not a timing)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway, wait_for

from herd.api.crd import KVCacheAwareRouting
from herd.orchestrator.app import AppSettings
from herd.orchestrator.registry import RegistrySettings

pytestmark = pytest.mark.timeout(120)

PROMPT_BYTES = 2 * 1024 * 1024
"""Long enough that the tiny model's tokenizer takes seconds over it, far longer than a request."""
SETTINGS = AppSettings(registry=RegistrySettings(poll_interval=0.02), max_body_bytes=4 * PROMPT_BYTES)


class TracedEncode:
    """Wraps a renderer's ``encode`` to record when tokenizing the large prompt starts and ends."""

    def __init__(self, encode: Any) -> None:
        self.encode = encode
        self.started, self.finished = threading.Event(), threading.Event()

    def __call__(self, text: str, **kwargs: Any) -> list[int]:
        is_large = len(text) >= PROMPT_BYTES
        if is_large:
            self.started.set()
        try:
            return list(self.encode(text, **kwargs))
        finally:
            if is_large:
                self.finished.set()


async def test_the_loop_answers_while_a_large_prompt_is_tokenized(tiny_llama: Path) -> None:
    routing = KVCacheAwareRouting(strategy="kv_cache_aware")
    config = {"model_path": tiny_llama, "max_model_len": 4096}
    cluster = FakeCluster([FakeWorker("w0")])
    async with running_gateway(cluster, routing=routing, settings=SETTINGS, model_config=config) as (
        app,
        client,
    ):
        renderer = app.state.registry.models[MODEL].renderer
        traced = renderer.encode = TracedEncode(renderer.encode)
        large = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "llama " * (PROMPT_BYTES // 6 + 1)}],
        }
        pending = asyncio.create_task(client.post("/v1/chat/completions", json=large))
        await wait_for(traced.started.is_set, within=60)
        answers = [await client.get(path) for path in ("/v1/models", "/health") * 3]
        was_tokenizing = not traced.finished.is_set()
        refused = await pending
    assert [answer.status_code for answer in answers] == [200] * 6
    assert was_tokenizing, "the event loop answered only once tokenization had finished"
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"  # past maxModelLen
    assert cluster.workers[0].num_requests == 0
