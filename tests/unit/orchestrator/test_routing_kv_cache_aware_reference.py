"""kv_cache_aware picks exactly what a plain computation of its documented cost picks, over randomized
fleets: full pools, lower tiers, expected blocks, peer pulls, workers at the bounded-load cap, ties.

The strategy prices only the workers whose lower bound can reach the least cost (``_candidates``:
from ``BOUND_MIN_WORKERS`` workers on, and here on every fleet too); the reference below prices every
worker the way the module's docstring reads, one worker at a time.
Restore and pull costs are multiples of a quarter token so that both sum the terms exactly; the
load term is built in the same order in both, so equal costs stay equal.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import pytest
from support.routing_views import kv_cache_aware

from herd.api.crd import TierWeights
from herd.api.protocol import KVSnapshot
from herd.orchestrator.kv_index import KVIndex, TierRun
from herd.orchestrator.routing import RequestContext, WorkerView
from herd.orchestrator.routing import kv_cache_aware as kv_cache_aware_module
from herd.orchestrator.routing._load import MIN_CAP
from herd.orchestrator.routing.kv_cache_aware import LEASE_WAIT_SHARE, MIN_RUN_BLOCKS, REQUEST_SHARE

BLOCK = 16
LOAD_FACTOR = 1.25
TIER_WEIGHTS = TierWeights(host=0.75, disk=0.5)
TierCost = Literal["measured", "weights", "device"]


@dataclass(frozen=True)
class Case:
    workers: list[WorkerView]
    index: KVIndex
    ctx: RequestContext
    tier_cost: TierCost
    peer_pulls: bool
    cache_weight: float
    load_weight: float


def _fleet(seed: int) -> Case:
    """A random fleet around one prompt; about a third of the workers copy another's load, so equal
    costs are common."""
    rng = random.Random(seed)
    num_blocks = rng.choice([0, 1, 4, 8, 12])
    prompt = [rng.getrandbits(60) for _ in range(num_blocks)]
    workers: list[WorkerView] = []
    for i in range(rng.choice([1, 2, 5, 20, 60, 200])):
        worker = WorkerView(
            id=f"w{i:03d}",
            url=f"http://w{i}:8000",
            num_in_flight=rng.choice([0, 0, 0, 1, 2, 3, 5, 8]),
            num_running=rng.choice([0, 0, 1, 3]),
            num_waiting=rng.choice([0, 0, 1]),
            num_waiting_prefill_tokens=rng.choice([0, 0, 0, 48, 171, 400]),
            num_prefill_tokens_in_flight=rng.choice([0, 0, 100, 300]),
            num_total_blocks=rng.choice([0, 8, 12, 20, 40, 400]),
            max_batch_tokens=rng.choice([0, 64, 256]),
            prefill_tokens_per_s=rng.choice([None, 400.0, 2000.0]),
            decode_step_s=rng.choice([None, 0.02, 0.1]),
            host_block_tokens=rng.choice([None, 0.5, 4.0, 16.0, 20.25]),
            disk_block_tokens=rng.choice([None, 1.0, 12.75, 24.0]),
            pull_block_tokens=rng.choice([None, 0.5, 8.0, 16.0, 24.0]),
        )
        if workers and rng.random() < 0.35:
            twin = rng.choice(workers)
            loads = ("num_in_flight", "num_running", "num_waiting", "num_waiting_prefill_tokens")
            worker = replace(
                worker,
                **{field: getattr(twin, field) for field in loads},  # type: ignore[arg-type]
                num_prefill_tokens_in_flight=twin.num_prefill_tokens_in_flight,
            )
        workers.append(worker)
    index = KVIndex()
    for worker in workers:
        if rng.random() < 0.4:
            continue
        device = rng.randint(0, num_blocks)
        host = rng.randint(device, num_blocks)
        disk = rng.randint(host, num_blocks)
        other = [rng.getrandbits(60) for _ in range(rng.choice([0, 4, 10]))]
        snapshot = KVSnapshot(
            epoch="e",
            seq=0,
            block_size=BLOCK,
            block_hashes=prompt[:device] + other,
            tier_block_hashes={"host": prompt[device:host], "disk": prompt[host:disk]},
        )
        index.reset(worker.id, snapshot)
        if rng.random() < 0.2:
            index.expect(worker.id, prompt[: rng.randint(0, num_blocks)])
    num_tokens = BLOCK * num_blocks + rng.choice([0, 0, 5, 15])
    ctx = RequestContext(model="m", token_ids=range(num_tokens), block_hashes=prompt)
    cache_weight, load_weight = rng.choice([(1.0, 1.0), (0.5, 2.0), (0.0, 1.0), (1.0, 0.0), (2.0, 0.5)])
    tier_cost: TierCost = rng.choice(["measured", "weights", "device"])
    return Case(workers, index, ctx, tier_cost, rng.random() < 0.4, cache_weight, load_weight)


def _reference_costs(
    case: Case, wait_share: float = LEASE_WAIT_SHARE, with_decodes: bool = True
) -> list[float]:
    """The documented cost of every worker, one at a time (``wait_share``: of a peer's step, and
    ``with_decodes``: whether its decode step counts, for the coverage check)."""
    workers, ctx, index = case.workers, case.ctx, case.index
    n, num_blocks = len(ctx.token_ids), len(ctx.block_hashes)
    cap = max(MIN_CAP, math.ceil(LOAD_FACTOR * (sum(w.num_in_flight for w in workers) + 1) / len(workers)))
    if not num_blocks:
        runs: dict[str, TierRun] = {}
    elif case.tier_cost == "device":
        runs = {worker_id: TierRun(length) for worker_id, length in index.match(ctx.block_hashes).items()}
    else:
        runs = index.match_tiers(ctx.block_hashes)
    # A leading run shorter than MIN_RUN_BLOCKS counts as none: the prompt is priced as uncached there.
    runs = {worker_id: run for worker_id, run in runs.items() if run.length >= MIN_RUN_BLOCKS}
    peer_runs = index.match(ctx.block_hashes, include_expected=False, include_host=True) if num_blocks else {}
    # The same rule for a peer's run; a peer lends after its step in progress.
    lendable = {w: run for w, run in peer_runs.items() if run >= MIN_RUN_BLOCKS and case.peer_pulls}

    def lease_wait(p: WorkerView) -> float:
        queued = max(p.num_prefill_tokens_in_flight, p.num_waiting_prefill_tokens)
        prefill = min(queued, p.max_batch_tokens) if p.max_batch_tokens else queued
        busy = max(p.num_running + p.num_waiting, p.num_in_flight) > 0
        measured = p.decode_step_s is not None and p.prefill_tokens_per_s is not None
        decode = p.decode_step_s * p.prefill_tokens_per_s if busy and measured and with_decodes else 0.0  # type: ignore[operator]
        return wait_share * (prefill + decode)

    def pull_saving(w: WorkerView, own_run: int) -> float:
        """The most any peer's pull saves ``w``, never below nothing."""
        pull = w.pull_block_tokens
        if pull is None or pull >= BLOCK:
            return 0.0
        savings = [
            (lendable[p.id] - own_run) * (BLOCK - pull) - lease_wait(p)
            for p in workers
            if p.id != w.id and lendable.get(p.id, 0) > own_run
        ]
        return max([0.0, *savings])

    held = index.held_blocks()
    per_request = n * REQUEST_SHARE

    def cost(w: WorkerView) -> float:
        if w.num_in_flight >= cap:
            return math.inf
        run = runs.get(w.id, TierRun(0))
        if case.tier_cost == "weights":
            host, disk = BLOCK * (1 - TIER_WEIGHTS.host), BLOCK * (1 - TIER_WEIGHTS.disk)
        else:
            host = BLOCK if w.host_block_tokens is None else w.host_block_tokens
            disk = BLOCK if w.disk_block_tokens is None else w.disk_block_tokens
        restore = run.host * host + run.disk * disk
        new_device_blocks = num_blocks - run.device - w.num_total_blocks + held.get(w.id, 0)
        evicted = BLOCK * max(0, new_device_blocks) if w.num_total_blocks else 0
        pulled = pull_saving(w, max(run.length, lendable.get(w.id, 0)))
        tokens = n - BLOCK * run.length + restore + evicted - pulled
        queued = max(w.num_prefill_tokens_in_flight, w.num_waiting_prefill_tokens)
        requests = max(w.num_running + w.num_waiting, w.num_in_flight)
        return case.cache_weight * tokens + case.load_weight * (queued + per_request * requests)

    return [cost(w) for w in workers]


def _reference_pick(case: Case, costs: Sequence[float], seed: int) -> str:
    """The least cost; ties to the fewest in flight, then the fewest cached blocks, then at random."""
    tied = [w for w, cost in zip(case.workers, costs, strict=True) if cost == min(costs)]
    if len(tied) == 1:
        return tied[0].id
    tied = [w for w in tied if w.num_in_flight == min(w.num_in_flight for w in tied)]
    held, expected = case.index.held_blocks(), case.index.expected_blocks()
    sizes = [held.get(w.id, 0) + expected.get(w.id, 0) for w in tied]
    tied = [w for w, size in zip(tied, sizes, strict=True) if size == min(sizes)]
    return tied[0].id if len(tied) == 1 else random.Random(seed).choice(tied).id


@pytest.mark.parametrize("bound_from", [0, kv_cache_aware_module.BOUND_MIN_WORKERS], ids=["bound", "default"])
@pytest.mark.parametrize("seed", range(400))
def test_the_choice_is_the_least_documented_cost(
    seed: int, bound_from: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fleet with the bound (whatever its size) and as the strategy runs by default."""
    monkeypatch.setattr(kv_cache_aware_module, "BOUND_MIN_WORKERS", bound_from)
    case = _fleet(seed)
    strategy = kv_cache_aware(
        case.index,
        seed=seed,
        load_factor=LOAD_FACTOR,
        cache_weight=case.cache_weight,
        load_weight=case.load_weight,
        tier_cost=case.tier_cost,
        tier_weights=TIER_WEIGHTS,
        peer_pulls=case.peer_pulls,
    )
    chosen = strategy.select(case.workers, case.ctx)
    assert chosen is not None
    assert chosen.id == _reference_pick(case, _reference_costs(case), seed)


def test_the_fleets_cover_ties_full_pools_caps_tiers_and_pulls() -> None:
    """The randomized fleets above reach every path the fast one must agree on, lease waits too."""
    cases = [_fleet(seed) for seed in range(400)]
    costs = [_reference_costs(case) for case in cases]
    ties = sum(1 for c in costs if sum(1 for cost in c if cost == min(c)) > 1)
    capped = sum(1 for c in costs if math.inf in c)
    tiered = sum(
        1
        for case in cases
        if case.tier_cost != "device"
        and case.ctx.block_hashes
        and any(run.host or run.disk for run in case.index.match_tiers(case.ctx.block_hashes).values())
    )
    full = sum(
        1
        for case in cases
        for w in case.workers
        if w.num_total_blocks
        and case.index.num_blocks(w.id) + len(case.ctx.block_hashes) > w.num_total_blocks
    )
    pulls = sum(
        1
        for case in cases
        if case.peer_pulls
        and case.index.match(case.ctx.block_hashes, include_expected=False, include_host=True)
    )
    waited = sum(1 for case, c in zip(cases, costs, strict=True) if _reference_costs(case, 0.0) != c)
    assert min(ties, capped, tiered, full, pulls) >= 40, (ties, capped, tiered, full, pulls)
    assert waited >= 10, waited  # fleets where a peer's lease wait changes some worker's cost
    decoded = sum(
        1 for case, c in zip(cases, costs, strict=True) if _reference_costs(case, with_decodes=False) != c
    )
    assert decoded >= 5, decoded  # ... and where its decode step does (8 of its 20)
