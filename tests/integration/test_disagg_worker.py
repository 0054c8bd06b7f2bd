"""Disaggregation between real tiny-model workers in process: prefill, KV pull, decode.

Three engines: a prefill worker, a decode worker (its KV pulls reach the prefill worker's internal
app through the in-process transport) and a unified worker as the reference for greedy outputs.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support.disagg import HostDispatch, InProcessWorker, sentence, start_worker
from support.disagg import greedy_chat as chat
from support.worker_server import sse_data

from herd.api.kv_hash import block_hashes
from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

CHAT = "/v1/chat/completions"
BLOCK = 16
LAYOUT_FIELDS = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")

Workers = dict[str, InProcessWorker]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers(tiny_llama: Path) -> AsyncIterator[Workers]:
    dispatch = HostDispatch()
    async with httpx.AsyncClient(transport=dispatch, timeout=60) as http:
        roles = (("prefill", "prefill"), ("decode", "decode"), ("unified", "unified"))
        built = {name: await start_worker(tiny_llama, name, role, dispatch, http) for name, role in roles}  # type: ignore[arg-type]
        yield built
        for worker in built.values():
            await worker.engine.stop()


async def prefill(worker: InProcessWorker, body: dict[str, Any], **params: Any) -> dict[str, Any]:
    response = await worker.internal(
        INTERNAL_PATHS.prefill, {**body, "kv_transfer_params": {"do_remote_decode": True, **params}}
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def release(worker: InProcessWorker, params: dict[str, Any]) -> httpx.Response:
    return await worker.internal(
        INTERNAL_PATHS.kv_release, {"remote_request_id": params["remote_request_id"]}
    )


async def disaggregated(workers: Workers, body: dict[str, Any]) -> dict[str, Any]:
    params = await prefill(workers["prefill"], body)
    response = await workers["decode"].public(CHAT, {**body, "kv_transfer_params": params})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def unified_text(workers: Workers, body: dict[str, Any]) -> str:
    response = await workers["unified"].public(CHAT, body)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


async def received_blocks(worker: InProcessWorker) -> float:
    return await worker.metric("herd_kv_transfer_blocks_total", direction="received")


async def prompt_tokens(worker: InProcessWorker, body: dict[str, Any]) -> list[int]:
    tokens: list[int] = (await worker.public("/tokenize", {"messages": body["messages"]})).json()["tokens"]
    return tokens


def num_pullable(tokens: list[int]) -> int:
    """The prompt's full blocks: the prefill worker leases them all."""
    return len(tokens) // BLOCK


async def num_held_blocks(worker: InProcessWorker, tokens: list[int]) -> int:
    """How many of the prompt's pullable blocks the worker's prefix cache holds now."""
    held = set((await worker.internal(INTERNAL_PATHS.kv_snapshot)).json()["block_hashes"])
    hashes = block_hashes(tokens, BLOCK, model_id="tiny")[: num_pullable(tokens)]
    return sum(1 for block_hash in hashes if block_hash in held)


async def assert_every_block_free(workers: Workers) -> None:
    for worker in workers.values():
        assert await worker.settled_free_blocks() == await worker.total_blocks(), worker.id


async def test_greedy_outputs_through_prefill_and_decode_equal_a_unified_worker(workers: Workers) -> None:
    rng = random.Random(5)
    decode = workers["decode"]
    for number in range(20):
        shared = sentence(rng, 30 + number)
        body = chat(shared + " " + sentence(rng, 20 + 3 * number))
        if number % 2:  # the decode worker holds the shared prefix already: only the rest moves
            await decode.public(CHAT, chat(shared, max_tokens=1))
        tokens = await prompt_tokens(decode, body)
        num_cached = await num_held_blocks(decode, tokens)
        assert num_cached > 0 or not number % 2
        before = await received_blocks(decode)
        result = await disaggregated(workers, body)
        moved = await received_blocks(decode) - before
        assert result["choices"][0]["message"]["content"] == await unified_text(workers, body), number
        assert moved == num_pullable(tokens) - num_cached, number
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] >= (moved + num_cached) * BLOCK
    await assert_every_block_free(workers)


async def test_decode_streams_the_same_tokens(workers: Workers) -> None:
    body = chat(sentence(random.Random(11), 70))
    params = await prefill(workers["prefill"], body)
    response = await workers["decode"].public(CHAT, {**body, "stream": True, "kv_transfer_params": params})
    assert response.status_code == 200, response.text
    events = sse_data(response.text)
    assert events[-1] == "[DONE]"
    deltas = [event["choices"][0]["delta"].get("content") or "" for event in events[:-1] if event["choices"]]
    assert "".join(deltas) == await unified_text(workers, body)


async def test_prefill_holds_blocks_until_the_decode_side_releases_them(workers: Workers) -> None:
    worker = workers["prefill"]
    params = await prefill(worker, chat(sentence(random.Random(12), 60)))
    assert len(params["remote_block_ids"]) == len(params["remote_block_hashes"]) > 0
    assert params["first_token_ids"] and params["remote_host"] == "prefill.internal"
    assert params["remote_port"] == 9000
    held = await worker.total_blocks() - len(params["remote_block_ids"])
    assert await worker.settled_free_blocks(held) == held
    released = await release(worker, params)
    assert released.json() == {"num_released_blocks": len(params["remote_block_ids"])}
    assert await worker.settled_free_blocks() == await worker.total_blocks()


async def test_a_prefill_counts_as_a_one_token_request_in_the_request_metrics(workers: Workers) -> None:
    """The prefill pool's TTFT is what its dashboards and the autoscaler read."""
    worker = workers["prefill"]
    ttft_before = await worker.metric("vllm:time_to_first_token_seconds_count")
    e2e_before = await worker.metric("vllm:e2e_request_latency_seconds_count")
    itl_before = await worker.metric("vllm:inter_token_latency_seconds_count")
    params = await prefill(worker, chat(sentence(random.Random(13), 40)))
    assert await worker.metric("vllm:time_to_first_token_seconds_count") == ttft_before + 1
    assert await worker.metric("vllm:e2e_request_latency_seconds_count") == e2e_before + 1
    assert await worker.metric("vllm:inter_token_latency_seconds_count") == itl_before
    await release(worker, params)


async def test_an_expired_lease_frees_its_blocks_and_is_counted(workers: Workers) -> None:
    worker = workers["prefill"]
    expired_before = await worker.metric("herd_kv_leases_expired_total")
    # long enough that even a loaded machine sees the blocks held first; then wait for the expiry
    params = await prefill(worker, chat(sentence(random.Random(13), 60)), lease_seconds=5.0)
    total = await worker.total_blocks()
    held = total - len(params["remote_block_ids"])
    assert await worker.settled_free_blocks(held) == held
    for _ in range(12):  # settled_free_blocks waits up to 2.5 s itself: about 30 s in all
        if await worker.settled_free_blocks() == total:
            break
    assert await worker.settled_free_blocks() == total
    assert await worker.metric("herd_kv_leases_expired_total") == expired_before + 1
    body = {
        "remote_request_id": params["remote_request_id"],
        "block_hashes": params["remote_block_hashes"][:1],
        "layout": layout(workers["decode"]),
    }
    gone = await worker.internal(INTERNAL_PATHS.kv_blocks, body)
    assert gone.status_code == 404 and "prefill the request locally" in gone.json()["error"]["message"]


async def test_decode_prefills_locally_when_the_lease_is_gone(workers: Workers) -> None:
    body = chat(sentence(random.Random(14), 80))
    params = await prefill(workers["prefill"], body)
    await release(workers["prefill"], params)
    before = await received_blocks(workers["decode"])
    response = await workers["decode"].public(CHAT, {**body, "kv_transfer_params": params})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == await unified_text(workers, body)
    assert await received_blocks(workers["decode"]) == before
    await assert_every_block_free(workers)


def layout(worker: InProcessWorker) -> dict[str, Any]:
    return {name: getattr(worker.engine.info, name) for name in LAYOUT_FIELDS}


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_size", 32), ("dtype", "bfloat16"), ("num_layers", 3), ("head_dim", 64), ("model", "other")],
    ids=["block-size", "dtype", "layers", "head-dim", "model"],
)
async def test_the_prefill_side_refuses_a_foreign_layout(workers: Workers, field: str, value: Any) -> None:
    params = await prefill(workers["prefill"], chat(sentence(random.Random(15), 40)), lease_seconds=1)
    body = {
        "remote_request_id": params["remote_request_id"],
        "block_hashes": params["remote_block_hashes"],
        "layout": {**layout(workers["decode"]), field: value},
    }
    response = await workers["prefill"].internal(INTERNAL_PATHS.kv_blocks, body)
    assert response.status_code == 409
    assert field in response.json()["error"]["message"]
    await release(workers["prefill"], params)


async def test_the_decode_side_refuses_blocks_of_another_prompt(workers: Workers) -> None:
    body = chat(sentence(random.Random(16), 60))
    params = await prefill(workers["prefill"], body)
    params["remote_block_hashes"] = [block_hash ^ 1 for block_hash in params["remote_block_hashes"]]
    response = await workers["decode"].public(CHAT, {**body, "kv_transfer_params": params})
    assert response.status_code == 409
    assert "different models" in response.json()["error"]["message"]
    await assert_every_block_free(workers)


async def forced_first_token(workers: Workers, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A prefill whose logit bias forces a first token the model would not pick greedily."""
    plain = await prefill(workers["prefill"], body)
    await release(workers["prefill"], plain)
    forced = (plain["first_token_ids"][0] + 1) % 200
    params = await prefill(workers["prefill"], {**body, "logit_bias": {str(forced): 100.0}})
    assert params["first_token_ids"] == [forced]  # sampled with the request's own settings
    return forced, params


async def test_the_decode_side_continues_from_the_prefill_workers_first_token(workers: Workers) -> None:
    prompt = (await workers["decode"].public("/tokenize", {"prompt": sentence(random.Random(17), 50)})).json()
    body = {
        "model": "tiny",
        "prompt": prompt["tokens"],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    forced, params = await forced_first_token(workers, body)
    handed = await workers["decode"].public("/v1/completions", {**body, "kv_transfer_params": params})
    assert handed.status_code == 200, handed.text
    # the rest is what a unified worker generates after the prompt plus that token
    reference = {**body, "prompt": [*prompt["tokens"], forced], "max_tokens": 5}
    rest = (await workers["unified"].public("/v1/completions", reference)).json()["choices"][0]["text"]
    text = handed.json()["choices"][0]["text"]
    assert text.endswith(rest) and len(text) > len(rest)
    assert handed.json()["usage"]["completion_tokens"] == 6
    await assert_every_block_free(workers)


async def test_a_seeded_request_samples_its_first_token_again(workers: Workers) -> None:
    body = chat(sentence(random.Random(18), 50), temperature=1.0, seed=3)
    _, params = await forced_first_token(workers, body)
    response = await workers["decode"].public(CHAT, {**body, "kv_transfer_params": params})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == await unified_text(workers, body)
    await assert_every_block_free(workers)


async def test_handed_prompt_ids_are_run_instead_of_rendering_the_messages(workers: Workers) -> None:
    body = chat(sentence(random.Random(19), 40))
    tokens = await prompt_tokens(workers["decode"], body)
    handed = {**chat("anything else"), "kv_transfer_params": {"prompt_token_ids": tokens}}
    response = await workers["decode"].public(CHAT, handed)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == await unified_text(workers, body)
    assert response.json()["usage"]["prompt_tokens"] == len(tokens)


@pytest.mark.parametrize(
    ("prompt_token_ids", "words"),
    [([1, 10**6], "token id 1000000"), ([], "at least 1"), (list(range(600)), "maxModelLen")],
    ids=["past-the-vocabulary", "empty", "past-the-context"],
)
@pytest.mark.parametrize("side", ["decode", "prefill"])
async def test_prompt_ids_a_client_hands_a_worker_are_checked(
    workers: Workers, side: str, prompt_token_ids: list[int], words: str
) -> None:
    """Handed ids bypass no check: the same vocabulary and length rules as any prompt ids."""
    if side == "decode":
        params: dict[str, Any] = {"prompt_token_ids": prompt_token_ids}
        response = await workers["decode"].public(CHAT, {**chat("hi"), "kv_transfer_params": params})
    else:
        params = {"do_remote_decode": True, "prompt_token_ids": prompt_token_ids}
        response = await workers["prefill"].internal(
            INTERNAL_PATHS.prefill, {**chat("hi"), "kv_transfer_params": params}
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("kv_transfer_params") and words in error["message"], error
    await assert_every_block_free(workers)


@pytest.mark.parametrize("token", [None, "a-guess"], ids=["no-token", "wrong-token"])
async def test_only_the_orchestrator_may_name_a_worker_to_pull_from(
    workers: Workers, token: str | None
) -> None:
    """A pull sends the internal token to the host in kv_transfer_params: a client that could name
    that host would learn the token and could plant KV blocks, so the decode side refuses it first."""
    body = chat(sentence(random.Random(11), 40))
    params = await prefill(workers["prefill"], body)
    decode = workers["decode"]
    received = await received_blocks(decode)
    headers = {} if token is None else {TOKEN_HEADER: token}
    response = await decode.http.post(
        decode.endpoint.url + CHAT, json={**body, "kv_transfer_params": params}, headers=headers
    )
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == ("kv_transfer_params", "permission_error")
    assert await received_blocks(decode) == received
    assert (await release(workers["prefill"], params)).status_code == 200
    await assert_every_block_free(workers)


async def test_a_constrained_first_token_obeys_the_grammar_and_the_decode_side_continues_past_it(
    workers: Workers,
) -> None:
    """Issue 15: the prefill worker samples the first token under the request's grammar, and the
    decode worker's matcher advances past it; the output equals a unified worker's, as valid JSON."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Rome"]},
            "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    body = chat(
        sentence(random.Random(21), 60), max_tokens=40, ignore_eos=False, response_format=response_format
    )
    params = await prefill(workers["prefill"], body)
    first = params["first_token_ids"]
    assert first and workers["decode"].engine.renderer.decode(first).startswith("{")
    response = await workers["decode"].public(CHAT, {**body, "kv_transfer_params": params})
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"]
    assert content == await unified_text(workers, body)
    assert json.loads(content)["city"] in {"Paris", "Rome"}
    await assert_every_block_free(workers)
