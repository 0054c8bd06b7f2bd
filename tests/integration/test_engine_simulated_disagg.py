"""Disaggregation is a capability of every engine: two workers on the cost-model runner run the
whole prefill, lease, KV pull and decode path of the real servers, placeholders in the frames."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from support.disagg import HostDispatch, InProcessWorker, start_worker

from herd.api.protocol import INTERNAL_PATHS
from herd.worker.simulated_runner import CostModel, simulated_engine

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

BLOCK = 16
BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "the cat sat on a mat " * 12}],
    "max_tokens": 4,
    "ignore_eos": True,
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers(tiny_llama: Path) -> AsyncIterator[dict[str, InProcessWorker]]:
    build = partial(simulated_engine, num_blocks=64, cost=CostModel(step_ms=0.0, token_ms=0.0))
    dispatch = HostDispatch()
    async with httpx.AsyncClient(transport=dispatch, timeout=60) as http:
        built = {
            role: await start_worker(tiny_llama, role, role, dispatch, http, build)  # type: ignore[arg-type]
            for role in ("prefill", "decode")
        }
        yield built
        for worker in built.values():
            await worker.engine.stop()


async def test_a_simulated_prefill_worker_hands_its_blocks_to_a_simulated_decode_worker(
    workers: dict[str, InProcessWorker],
) -> None:
    prefill, decode = workers["prefill"], workers["decode"]
    leased = await prefill.internal(
        INTERNAL_PATHS.prefill, {**BODY, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert leased.status_code == 200, leased.text
    params = leased.json()
    num_blocks = len(params["remote_block_ids"])
    assert num_blocks == params["num_prompt_tokens"] // BLOCK > 0
    answer = await decode.public("/v1/chat/completions", {**BODY, "kv_transfer_params": params})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == num_blocks * BLOCK
    assert await decode.metric("herd_kv_transfer_blocks_total", direction="received") == num_blocks
    for worker in (prefill, decode):
        assert await worker.settled_free_blocks() == await worker.total_blocks(), worker.id
