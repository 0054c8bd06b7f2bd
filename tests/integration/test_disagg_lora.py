"""Disaggregation with a LoRA adapter: prefill and decode pools carry the same adapters, and the KV
blocks handed over keep the adapter in their hashes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support.disagg import HostDispatch, InProcessWorker, start_worker
from support.lora import make_peft_adapter

from herd.api.kv_hash import block_hashes
from herd.api.protocol import INTERNAL_PATHS

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

CHAT = "/v1/chat/completions"
TEXT = "the cat sat on a mat while seven dogs ran far away under the old bridge " * 4

Workers = dict[str, InProcessWorker]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Workers]:
    adapter = make_peft_adapter(tiny_llama, tmp_path_factory.mktemp("disagg-lora") / "sql", rank=8, seed=9)
    dispatch = HostDispatch()
    async with httpx.AsyncClient(transport=dispatch, timeout=60) as http:
        built = {
            role: await start_worker(tiny_llama, role, role, dispatch, http, lora_modules={"sql": adapter})  # type: ignore[arg-type]
            for role in ("prefill", "decode", "unified")
        }
        built["plain"] = await start_worker(tiny_llama, "plain", "prefill", dispatch, http)
        yield built
        for worker in built.values():
            await worker.engine.stop()


def chat(model: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": TEXT}]
    return {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


async def content(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


async def test_an_adapters_blocks_move_under_the_adapters_hashes(workers: Workers) -> None:
    prefill, decode = workers["prefill"], workers["decode"]
    body = chat("sql")
    answer = await prefill.internal(
        INTERNAL_PATHS.prefill, {**body, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert answer.status_code == 200, answer.text
    params = answer.json()
    tokens = (await decode.public("/tokenize", {"messages": body["messages"]})).json()["tokens"]
    ours = block_hashes(tokens, 16, model_id="tiny", lora_name="sql")[: len(tokens) // 16]
    assert params["remote_block_hashes"] == ours
    assert not set(ours) & set(block_hashes(tokens, 16, model_id="tiny"))
    result = await content(await decode.public(CHAT, {**body, "kv_transfer_params": params}))
    held = set((await decode.internal(INTERNAL_PATHS.kv_snapshot)).json()["block_hashes"])
    assert set(ours) <= held
    assert result == await content(await workers["unified"].public(CHAT, body))
    assert result != await content(await workers["unified"].public(CHAT, chat("tiny")))


async def test_a_prefill_worker_without_the_adapter_refuses_it(workers: Workers) -> None:
    body = {**chat("sql"), "kv_transfer_params": {"do_remote_decode": True}}
    answer = await workers["plain"].internal(INTERNAL_PATHS.prefill, body)
    assert answer.status_code == 404 and "'sql'" in answer.json()["error"]["message"]
