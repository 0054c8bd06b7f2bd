"""Peer pulls in kv_cache_aware and ``decide``: pulling a peer's cached prefix, computing it, or going to
the holder, whichever costs the fewest prompt tokens by the workers' measured rates."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway, wait_for
from support.routing_views import context, kv_cache_aware, prompt_hashes, views

from herd.api.crd import KVCacheAwareRouting
from herd.api.kv_hash import block_hashes
from herd.api.prompt import PromptRenderer
from herd.api.protocol import WORKER_HEADER, KVSnapshot, LoadReport
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.kv_index import KVIndex, PromptMatch
from herd.orchestrator.routing import KVCacheAware, WorkerView, decide, pull_block_tokens
from herd.orchestrator.routing.kv_cache_aware import PeerOffer, best_pull, lease_wait_tokens
from herd.orchestrator.served import ServedModel
from herd.orchestrator.tokens import prompt_token_ids
from herd.orchestrator.validation import parse_request

PROMPT = prompt_hashes(7, 512)
"""32 blocks of 16 tokens: "h" holds the first 24 on its device, "p" the first 4, "c" none."""
HELD = {"h": 24, "p": 4}
ONE_RUNNING = {"num_running": 1}
"""A request in flight on a worker counts a third of the 512-token prompt (171 tokens)."""


def _index(*, expected_only: bool = False) -> KVIndex:
    index = KVIndex()
    for worker_id, num_blocks in HELD.items():
        blocks = [] if expected_only and worker_id == "h" else PROMPT[:num_blocks]
        index.reset(worker_id, KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=blocks))
    if expected_only:
        index.expect("h", PROMPT[:24])  # routed there a moment ago: nothing to lease yet
    return index


def _workers(pull: float | None, **fields: Mapping[str, float]) -> list[WorkerView]:
    return [
        replace(worker, pull_block_tokens=pull, **fields.get(worker.id, {}))  # type: ignore[arg-type]
        for worker in views("h", "p", "c")
    ]


def _strategy(index: KVIndex, *, peer_pulls: bool = True) -> KVCacheAware:
    return kv_cache_aware(index, seed=3, peer_pulls=peer_pulls)


@pytest.mark.parametrize(
    ("workers", "peer_pulls", "expected_only", "chosen", "pulled_from"),
    [
        # Costs in prompt tokens. h: 512 - 384 = 128 (+171 with a request running); p computes 448 or
        # pulls 20 blocks at (16 - pull) saved each; c computes 512 or pulls 24 blocks.
        (_workers(1.0), True, False, "h", None),
        (_workers(1.0, h=ONE_RUNNING), True, False, "p", "h"),
        (_workers(1.0, h=ONE_RUNNING), False, False, "h", None),
        (_workers(16.0, h=ONE_RUNNING), True, False, "h", None),
        (_workers(None, h=ONE_RUNNING), True, False, "h", None),
        (_workers(8.0, h=ONE_RUNNING), True, False, "p", "h"),
        (_workers(12.0, h=ONE_RUNNING), True, False, "h", None),
        (_workers(1.0, h=ONE_RUNNING, p=ONE_RUNNING), True, False, "c", "h"),
        (_workers(1.0, h=ONE_RUNNING), True, True, "h", None),
    ],
    ids=[
        "an-idle-holder-beats-a-pull",
        "a-busy-holder-loses-to-a-cheap-pull",
        "pulls-off-the-busy-holder-still-wins",
        "a-pull-as-slow-as-a-prefill-is-never-made",
        "an-unmeasured-pull-is-never-made",
        "a-pull-at-half-a-prefill-beats-the-busy-holder",
        "a-pull-at-three-quarters-loses-to-the-busy-holder",
        "the-idle-worker-pulls-the-whole-run",
        "blocks-only-expected-are-not-pulled",
    ],
)
def test_pull_compute_or_go_to_the_holder(
    workers: list[WorkerView], peer_pulls: bool, expected_only: bool, chosen: str, pulled_from: str | None
) -> None:
    strategy = _strategy(_index(expected_only=expected_only), peer_pulls=peer_pulls)
    choice = strategy.select(workers, context(PROMPT))
    assert choice is not None
    pull = strategy.pull_source(choice, workers, context(PROMPT))
    assert (choice.id, None if pull is None else pull.peer.id) == (chosen, pulled_from)


def _offer(peer_id: str, num_blocks: int, wait: float) -> PeerOffer:
    return PeerOffer(WorkerView(id=peer_id, url=f"http://{peer_id}"), num_blocks, wait)


LONG_BUSY, SHORT_IDLE = _offer("long", 24, 300.0), _offer("short", 12, 0.0)


@pytest.mark.parametrize(
    ("own", "cost", "offers", "saved", "pulled_from"),
    [
        (4, 1.0, [_offer("p", 24, 0.0)], 20 * 15, "p"),
        (4, 15.9, [_offer("p", 24, 0.0)], pytest.approx(20 * 0.1), "p"),
        (4, 16.0, [_offer("p", 24, 0.0)], 0.0, None),
        (4, None, [_offer("p", 24, 0.0)], 0.0, None),
        (24, 1.0, [_offer("p", 24, 0.0)], 0.0, None),
        (30, 1.0, [_offer("p", 24, 0.0)], 0.0, None),
        (4, 1.0, [_offer("p", 24, 300.0)], 0.0, None),  # 300 saved, 300 waited: nothing gained
        (4, 8.0, [LONG_BUSY, SHORT_IDLE], 8 * 8, "short"),  # 160 - 300 against 64
        (4, 1.0, [LONG_BUSY, SHORT_IDLE], 8 * 15, "short"),  # 300 - 300 against 120
        (0, 1.0, [LONG_BUSY, SHORT_IDLE], 12 * 15, "short"),  # 360 - 300 = 60 against 180
        (0, 0.0, [_offer("long", 48, 300.0), SHORT_IDLE], 48 * 16 - 300, "long"),
        (12, 1.0, [LONG_BUSY, SHORT_IDLE], 0.0, None),  # the idle one has nothing more to lend
    ],
    ids=[
        "cheap",
        "just-cheaper",
        "as-dear-as-computing",
        "unmeasured",
        "nothing-to-gain",
        "longer-own-run",
        "the-wait-eats-the-saving",
        "the-idle-shorter-run-beats-the-busy-longer-one",
        "a-saving-the-wait-cancels-loses",
        "from-nothing-the-idle-one-still-wins",
        "a-long-enough-run-is-worth-the-wait",
        "past-the-idle-one-only-the-busy-one-lends",
    ],
)
def test_the_best_pull_saves_the_most_after_the_lease_wait(
    own: int, cost: float | None, offers: list[PeerOffer], saved: float, pulled_from: str | None
) -> None:
    tokens, offer = best_pull(own, cost, offers, 16)
    assert (tokens, None if offer is None else offer.peer.id) == (saved, pulled_from)


@pytest.mark.parametrize(
    ("fields", "wait"),
    [
        ({}, 0.0),
        ({"num_running": 4}, 0.0),  # decode steps, not measured yet
        ({"num_running": 4, "decode_step_s": 0.05}, 0.0),  # no prefill rate to price them by
        ({"num_running": 4, "decode_step_s": 0.05, "prefill_tokens_per_s": 2000.0}, 100.0),
        ({"decode_step_s": 0.05, "prefill_tokens_per_s": 2000.0}, 0.0),  # nothing on it: no step
        ({"num_in_flight": 1, "decode_step_s": 0.05, "prefill_tokens_per_s": 2000.0}, 100.0),
        ({"num_waiting_prefill_tokens": 300}, 300.0),
        (
            {
                "num_waiting_prefill_tokens": 300,
                "num_running": 2,
                "decode_step_s": 0.05,
                "prefill_tokens_per_s": 2000.0,
            },
            400.0,
        ),
        ({"num_prefill_tokens_in_flight": 3000, "max_batch_tokens": 1024}, 1024.0),
        ({"num_prefill_tokens_in_flight": 3000}, 3000.0),  # no budget reported: the whole queue
    ],
    ids=[
        "idle",
        "decoding-unmeasured",
        "decoding-no-prefill-rate",
        "decoding",
        "idle-measured",
        "sent-one-not-reported-yet",
        "a-short-prefill",
        "a-short-prefill-and-decodes",
        "a-full-step",
        "budget-unknown",
    ],
)
def test_a_lease_waits_for_the_peers_step_in_progress(fields: dict[str, float], wait: float) -> None:
    assert lease_wait_tokens(WorkerView(id="p", url="http://p", **fields)) == wait  # type: ignore[arg-type]


def test_a_busy_holder_is_left_for_a_peer_whose_lease_waits_less() -> None:
    """The holder of the longest run is mid-prefill: its 1,024-token step outweighs the 16 blocks only
    it holds (240 tokens), so the idle worker pulls the shorter run from "g"."""
    index = _index()
    index.reset("g", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:8]))
    busy = {"num_prefill_tokens_in_flight": 4096, "max_batch_tokens": 1024, "num_in_flight": 3}
    workers = [*_workers(1.0, h=busy, p={"num_in_flight": 3}), *views("g", g=3)]
    strategy = _strategy(index)
    choice = strategy.select(workers, context(PROMPT))
    assert choice is not None and choice.id == "c"
    pull = strategy.pull_source(choice, workers, context(PROMPT))
    assert pull is not None and (pull.peer.id, pull.num_blocks) == ("g", 8)


def test_the_longest_peer_run_is_pulled_and_the_least_busy_among_equals() -> None:
    index = _index()
    index.reset("g", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:24]))
    index.reset("f", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:20]))
    workers = [*_workers(1.0, h={"num_in_flight": 3}), *views("g", "f", g=1)]
    pull = _strategy(index).pull_source(workers[2], workers, context(PROMPT))
    assert pull is not None and (pull.peer.id, pull.num_blocks) == ("g", 24)


@pytest.mark.parametrize(
    ("peer_blocks", "pulled_from"), [(1, None), (2, "g")], ids=["opening-only", "two-blocks"]
)
def test_a_peer_run_of_one_block_is_not_pulled(peer_blocks: int, pulled_from: str | None) -> None:
    """Every worker that served a chat holds its template's opening block, which the cost prices as
    uncached on every worker (``MIN_RUN_BLOCKS``): a peer's run of that block alone is no reason to
    pull (the puller holds it too, and the lease would wait for the peer's step for nothing)."""
    index = KVIndex()
    index.reset("g", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:peer_blocks]))
    index.reset("c", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:1]))
    workers = [replace(w, pull_block_tokens=1.0) for w in views("g", "c", g=3)]  # g busy: c is chosen
    strategy = _strategy(index)
    choice = strategy.select(workers, context(PROMPT))
    assert choice is not None and choice.id == "c"
    pull = strategy.pull_source(choice, workers, context(PROMPT))
    assert (None if pull is None else pull.peer.id) == pulled_from


def test_a_pull_cost_is_the_prefill_the_worker_does_while_a_block_arrives() -> None:
    report = LoadReport(prefill_tokens_per_s=500.0, bytes_per_block=720 * 1024, pull_bytes_per_s=300e6)
    assert pull_block_tokens(report) == pytest.approx(500 * 720 * 1024 / 300e6)
    assert pull_block_tokens(LoadReport(prefill_tokens_per_s=500.0, bytes_per_block=1024)) is None


def test_the_decision_names_the_peer_and_counts_only_the_tokens_left_to_compute() -> None:
    routing = KVCacheAwareRouting(strategy="kv_cache_aware", peer_pulls=True)
    served = ServedModel(ModelConfig("m", routing, block_size=16))
    for worker_id, num_blocks in HELD.items():
        snapshot = KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:num_blocks])
        served.kv_index.reset(worker_id, snapshot)
    workers = _workers(1.0, h=ONE_RUNNING)
    decision = decide(served, workers, context(PROMPT))
    assert decision.worker.id == "p" and decision.pull_from is not None and decision.pull_from.id == "h"
    assert (decision.num_cached_blocks, decision.num_prefill_tokens) == (4, 512 - 24 * 16)


def test_a_holder_at_its_limit_still_lends_and_the_choice_prices_its_run() -> None:
    """h holds 24 blocks and is at the limit of one request: no request goes to it, but the decision
    prices pulling its run. Then c, idle, pulls all 24 (512 - 360 = 152 tokens) and beats p, which
    holds 4 but has 40 tokens queued (448 - 300 + 40 = 188); priced among the open workers only, p's
    own 4 blocks won (488 against c's 4 from p, 492), and p pulled from h after the fact."""
    routing = KVCacheAwareRouting(strategy="kv_cache_aware", peer_pulls=True)
    served = ServedModel(ModelConfig("m", routing, block_size=16, max_in_flight_per_worker=1))
    for worker_id, num_blocks in HELD.items():
        snapshot = KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:num_blocks])
        served.kv_index.reset(worker_id, snapshot)
    workers = _workers(1.0, h={"num_in_flight": 1}, p={"num_waiting_prefill_tokens": 40})
    decision = decide(served, workers, context(PROMPT))
    assert decision.worker.id == "c" and decision.pull_from is not None and decision.pull_from.id == "h"
    assert decision.num_prefill_tokens == 512 - 24 * 16


def test_one_decision_looks_the_prompt_up_once() -> None:
    """``pull_source`` after ``select`` with the decision's own lookup and lenders reuses what
    ``select`` priced; the next decision (a new ``PromptMatch``) looks up afresh."""
    index = _index()
    strategy = _strategy(index)
    workers = _workers(1.0, h=ONE_RUNNING)
    looked_up: list[int] = []
    look_up = strategy._looked_up_for

    def counted(kv: PromptMatch, lenders: Sequence[WorkerView]) -> Any:
        looked_up.append(len(lenders))
        return look_up(kv, lenders)

    strategy._looked_up_for = counted  # type: ignore[method-assign]
    for _ in range(2):
        ctx = replace(context(PROMPT), kv=PromptMatch(index, PROMPT), lenders=workers)
        choice = strategy.select(workers[1:], ctx)
        assert choice is not None and choice.id == "p"
        pull = strategy.pull_source(choice, workers, ctx)
        assert pull is not None and pull.peer.id == "h"
    assert looked_up == [3, 3]  # once a decision, over the lenders rather than the two it chose among


def test_a_disaggregated_model_never_pulls_from_a_peer() -> None:
    routing = KVCacheAwareRouting(strategy="kv_cache_aware", peer_pulls=True)
    served = ServedModel(ModelConfig("m", routing, block_size=16, mode="disaggregated"))
    served.kv_index.reset("h", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:24]))
    workers = [WorkerView(id=i, url=f"http://{i}", role="decode", pull_block_tokens=1.0) for i in ("h", "p")]
    workers[0] = replace(workers[0], num_running=1)
    assert decide(served, workers, context(PROMPT, is_prefilled=True)).pull_from is None


MEASURED = LoadReport(prefill_tokens_per_s=500.0, bytes_per_block=1000, pull_bytes_per_s=1e6)
"""A pulled block costs 0.5 prefill tokens: far cheaper than computing its 16."""


@pytest.mark.parametrize(
    ("puller_load", "expected"),
    [(MEASURED, {"peer_url": "http://h.internal"}), (LoadReport(), None)],
    ids=["measured-pull", "unmeasured-pull"],
)
async def test_the_gateway_tells_the_chosen_worker_where_to_pull_from(
    tiny_llama: Path, puller_load: LoadReport, expected: dict[str, str] | None
) -> None:
    renderer = PromptRenderer.from_pretrained(tiny_llama)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long shared system prompt " * 30}]}
    parsed = parse_request("/v1/chat/completions", json.dumps(body).encode())
    hashes = block_hashes(prompt_token_ids(renderer, parsed.request, max_model_len=4096), 16, model_id=MODEL)
    busy = LoadReport(num_running=3, prefill_tokens_per_s=500.0)
    holder = FakeWorker("h", load=busy, snapshot_blocks=list(hashes))
    puller = FakeWorker("p", load=puller_load)
    routing = KVCacheAwareRouting(strategy="kv_cache_aware", peer_pulls=True)
    config = {"model_path": tiny_llama, "block_size": 16}
    cluster = FakeCluster([holder, puller])
    async with running_gateway(cluster, routing=routing, model_config=config) as (app, client):
        registry = app.state.registry
        await wait_for(lambda: registry.models[MODEL].kv_index.match(hashes).get("h", 0) == len(hashes))
        await wait_for(lambda: registry.workers["p"].report == puller_load)
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.headers[WORKER_HEADER] == "p"
    assert puller.bodies[-1].get("kv_transfer_params") == expected
