"""Peer pulls between real tiny-model workers in process: a worker routed a prompt whose prefix a
peer's device caches pulls those blocks (``kv_transfer_params.peer_url``) instead of computing them.

Three engines: a holder (it served the prompt's prefix first), a puller and a reference worker that
computes everything, for greedy outputs. The holder's internal app is reached through the in-process
transport, which can refuse a path to play a holder that died mid-pull.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support.disagg import TOKEN, HostDispatch, InProcessWorker, sentence, start_worker
from support.disagg import greedy_chat as chat

from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER, WorkerInfo
from herd.worker.kv_transfer import HttpKVTransfer, KVLayout

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

CHAT = "/v1/chat/completions"
BLOCK = 16


class Fleet:
    def __init__(self, dispatch: HostDispatch, workers: dict[str, InProcessWorker]) -> None:
        self.dispatch = dispatch
        self.holder, self.puller, self.reference = workers["holder"], workers["puller"], workers["reference"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tiny_llama: Path) -> AsyncIterator[Fleet]:
    dispatch = HostDispatch()
    async with httpx.AsyncClient(transport=dispatch, timeout=60) as http:
        names = ("holder", "puller", "reference")
        built = {name: await start_worker(tiny_llama, name, "unified", dispatch, http) for name in names}
        yield Fleet(dispatch, built)
        for worker in built.values():
            await worker.engine.stop()


@pytest.fixture(autouse=True)
def _heal(fleet: Fleet) -> None:
    fleet.dispatch.refused.clear()


async def answer(worker: InProcessWorker, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    response = await worker.http.post(worker.endpoint.url + CHAT, json=body, headers=headers)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def text(worker: InProcessWorker, body: dict[str, Any]) -> str:
    return str((await answer(worker, body))["choices"][0]["message"]["content"])


async def pulled_from(fleet: Fleet, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` on the puller, told to pull from the holder, as the orchestrator sends it."""
    params = {"peer_url": fleet.holder.endpoint.internal_url}
    response = await fleet.puller.public(CHAT, {**body, "kv_transfer_params": params})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def pulls(worker: InProcessWorker, outcome: str) -> float:
    return await worker.metric("herd_kv_peer_pulls_total", outcome=outcome)


async def leases(worker: InProcessWorker, end: str) -> float:
    """The leases ``worker`` gave whose run ended at ``end``, held blocks or not (a lease of only the
    chat template's opening block holds one the puller has too: an empty pull)."""
    return await worker.metric("herd_kv_leases_total", end=end)


async def every_block_free(fleet: Fleet) -> None:
    for worker in (fleet.holder, fleet.puller, fleet.reference):
        assert await worker.settled_free_blocks() == await worker.total_blocks(), worker.id


async def test_a_pulled_prefix_gives_the_same_greedy_output_as_computing_it(fleet: Fleet) -> None:
    for number in range(6):
        shared = sentence(random.Random(100 + number), 40 + 5 * number)
        body = chat(shared + " " + sentence(random.Random(200 + number), 12 + number))
        await answer(fleet.holder, chat(shared, max_tokens=1))  # the holder caches the prefix
        before = await pulls(fleet.puller, "pulled")
        lent = await leases(fleet.holder, "not_cached")
        result = await pulled_from(fleet, body)
        assert await pulls(fleet.puller, "pulled") == before + 1, number
        # the holder lent the shared prefix, not the question after it
        assert await leases(fleet.holder, "not_cached") == lent + 1, number
        cached = result["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= BLOCK * 2, number  # the pulled blocks count as the prompt's cached tokens
        assert result["choices"][0]["message"]["content"] == await text(fleet.reference, body), number
    load = await fleet.puller.load()
    assert load["pull_bytes_per_s"] > 0  # every fetch is timed into the worker's pull bandwidth
    await every_block_free(fleet)  # the holder's leases were released


async def test_a_holder_that_dies_between_its_lease_and_the_fetch_costs_a_recompute(fleet: Fleet) -> None:
    shared = sentence(random.Random(300), 50)
    body = chat(shared + " the end")
    await answer(fleet.holder, chat(shared, max_tokens=1))
    fleet.dispatch.refused.add(("holder.internal", INTERNAL_PATHS.kv_blocks))
    failed = await pulls(fleet.puller, "failed")
    result = await pulled_from(fleet, body)
    assert await pulls(fleet.puller, "failed") == failed + 1
    assert result["choices"][0]["message"]["content"] == await text(fleet.reference, body)
    await every_block_free(fleet)  # the lease was still released (only the block path was down)


async def test_a_holder_gone_before_the_pull_costs_a_recompute(fleet: Fleet) -> None:
    body = chat(sentence(random.Random(400), 60))
    fleet.dispatch.refused.add(("holder.internal", None))
    failed = await pulls(fleet.puller, "failed")
    result = await pulled_from(fleet, body)
    assert await pulls(fleet.puller, "failed") == failed + 1
    assert result["choices"][0]["message"]["content"] == await text(fleet.reference, body)


async def test_a_holder_that_no_longer_holds_the_prefix_lends_nothing(fleet: Fleet) -> None:
    body = chat(sentence(random.Random(500), 60))  # never sent to the holder
    empty = await pulls(fleet.puller, "empty")
    lent = await leases(fleet.holder, "not_cached")
    result = await pulled_from(fleet, body)
    assert await pulls(fleet.puller, "empty") == empty + 1
    assert await leases(fleet.holder, "not_cached") == lent + 1
    assert result["choices"][0]["message"]["content"] == await text(fleet.reference, body)
    await every_block_free(fleet)


@pytest.mark.parametrize("token", [None, "a-guess"], ids=["no-token", "wrong-token"])
async def test_only_the_orchestrator_may_name_a_peer_to_pull_from(fleet: Fleet, token: str | None) -> None:
    body = chat(
        sentence(random.Random(600), 40), kv_transfer_params={"peer_url": fleet.holder.endpoint.internal_url}
    )
    headers = {} if token is None else {TOKEN_HEADER: token}
    response = await fleet.puller.http.post(fleet.puller.endpoint.url + CHAT, json=body, headers=headers)
    assert response.status_code == 403, response.text
    assert response.json()["error"]["param"] == "kv_transfer_params"


async def test_the_transport_probe_sends_zero_blocks_in_the_askers_layout(fleet: Fleet) -> None:
    info = WorkerInfo.model_validate((await fleet.puller.internal(INTERNAL_PATHS.info)).json())
    transfer = HttpKVTransfer(fleet.puller.http, TOKEN)
    num_bytes, seconds = await transfer.probe(fleet.puller.endpoint.internal_url, KVLayout.of(info), 4)
    layout = KVLayout.of(info)
    per_block = 2 * layout.num_layers * BLOCK * layout.num_kv_heads * layout.head_dim * 4
    assert (num_bytes, seconds > 0) == (4 * per_block, True)
