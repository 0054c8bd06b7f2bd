"""bench/kv_tiers.py's fleet construction (tier profiles, which workers get the slow disk, the
per-worker cost models and load reports that follow from them) and its model of a peer pull."""

from __future__ import annotations

import heapq
import random
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import kv_tiers
from routing_sim import BLOCK_SIZE, ISSUE14_COST, MODEL_ID, Request

from herd.api.kv_hash import block_hashes
from herd.api.prompt import PromptRenderer
from herd.orchestrator.routing import restore_block_tokens
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.sampling_params import SamplingParams
from herd.worker.simulated_runner import CostModel, VirtualClock, simulated_engine

BLOCK_BYTES = 737_280  # the demo model's fp32 block of 16 tokens (720 KiB)
BLOCK_MS = BLOCK_SIZE * ISSUE14_COST["token_ms"]


@pytest.mark.parametrize(
    ("num_workers", "share", "slow"),
    [
        (4, 0.0, [False, False, False, False]),
        (4, 0.5, [False, True, False, True]),
        (4, 0.25, [False, False, False, True]),
        (3, 1.0, [True, True, True]),
        (8, 0.5, [False, True] * 4),
    ],
)
def test_slow_workers_spreads_the_share(num_workers: int, share: float, slow: list[bool]) -> None:
    assert kv_tiers.slow_workers(num_workers, share) == slow


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_slow_workers_refuses_a_share_outside_0_1(share: float) -> None:
    with pytest.raises(ValueError, match="slow-disk-share"):
        kv_tiers.slow_workers(4, share)


@pytest.mark.parametrize(
    ("profile", "host", "disk", "slow_disk", "pull"),
    [
        # Measured bandwidths pass through.
        ("cpu", 6.5, 0.6, 0.6, 0.11),
        # Ratios become bandwidths: move time = ratio x a block's recompute time (a pull: llm-d's
        # 551 ms against 1,695 ms recomputed).
        (
            "gpu-ratio",
            BLOCK_BYTES / (0.08 * BLOCK_MS / 1000) / 1e9,
            BLOCK_BYTES / (0.4 * BLOCK_MS / 1000) / 1e9,
            BLOCK_BYTES / (2.0 * BLOCK_MS / 1000) / 1e9,
            BLOCK_BYTES / (551 / 1695 * BLOCK_MS / 1000) / 1e9,
        ),
    ],
)
def test_profile_bandwidths(profile: str, host: float, disk: float, slow_disk: float, pull: float) -> None:
    got = kv_tiers.PROFILES[profile].bandwidths(BLOCK_BYTES, BLOCK_MS)
    assert got == pytest.approx((host, disk, slow_disk, pull))


def _request(number: int, num_tokens: int, num_cached: int, ttft_ms: float) -> Request:
    return Request(number, 0, [0] * num_tokens, [], sent_ms=100.0, first_token_ms=100.0 + ttft_ms,
                   num_cached_tokens=num_cached)  # fmt: skip


@pytest.mark.parametrize(
    ("requests", "split"),
    [
        ([_request(0, 100, 50, 10.0), _request(1, 100, 49, 90.0), _request(2, 100, 100, 30.0)],
         {"hit_requests": 2 / 3, "ttft_p50_hit_ms": 20.0, "ttft_p50_miss_ms": 90.0}),
        ([_request(0, 100, 0, 70.0)], {"hit_requests": 0.0, "ttft_p50_hit_ms": 0.0, "ttft_p50_miss_ms": 70.0}),
        ([_request(0, 64, 48, 5.0)], {"hit_requests": 1.0, "ttft_p50_hit_ms": 5.0, "ttft_p50_miss_ms": 0.0}),
    ],
    ids=["half-cached-hits", "all-miss", "all-hit"],
)  # fmt: skip
def test_hit_split_parts_requests_at_half_their_prompt_cached(
    requests: list[Request], split: dict[str, float]
) -> None:
    assert kv_tiers.hit_split(requests) == pytest.approx(split)


@pytest.mark.parametrize(
    ("hold_end_ms", "num_bytes", "gbps", "done_ms"),
    [
        (0.0, 0, 1.0, 0.0),  # an empty lease: the answer comes when the hold ends
        (100.0, 1_000_000, 1.0, 101.0),  # 1 MB at 1 GB/s: 1 ms after the hold
        (250.0, 4 * BLOCK_BYTES, 0.11, 250.0 + 4 * BLOCK_BYTES / 0.11e6),
    ],
)
def test_transfer_done_ms(hold_end_ms: float, num_bytes: int, gbps: float, done_ms: float) -> None:
    assert kv_tiers.transfer_done_ms(hold_end_ms, num_bytes, gbps) == pytest.approx(done_ms)


def _engine(demo_model: Path) -> LLMEngine:
    config = EngineConfig(
        model_path=demo_model,
        served_name=MODEL_ID,
        engine={"maxBatchTokens": 1024, "kvCache": {"blockSize": BLOCK_SIZE}},
    )
    return simulated_engine(config, num_blocks=32, cost=CostModel(**ISSUE14_COST), clock=VirtualClock())


def _serve(engine: LLMEngine, request_id: str, token_ids: list[int]) -> int:
    """Run one request to its end; its cached prompt tokens."""
    engine.add_request(request_id, token_ids, SamplingParams(max_tokens=2, ignore_eos=True))
    for _ in range(50):
        for output in engine.step():
            if output.finished:
                return output.num_cached_tokens
    raise AssertionError(f"request {request_id} did not finish")


PROMPT = random.Random(7).choices(range(1000, 40000), k=5 * BLOCK_SIZE + 3)
"""Five full blocks and a partial one."""


@pytest.mark.parametrize(
    ("peer_blocks", "puller_blocks", "wanted", "end", "cached_blocks"),
    [
        # The peer computed the first 4 blocks (and a tail of its own): the lease holds them and
        # stops at the 5th, which it never cached; the puller then hits all 4.
        (4, 0, [0, 1, 2, 3], "not_cached", 4),
        # The puller has 2 already: it asks for the rest, gets 2 more.
        (4, 2, [2, 3], "not_cached", 4),
        # The peer has nothing: the lease comes back empty and the puller computes the prompt.
        (0, 0, [], "not_cached", 0),
        # The peer holds less than the puller: nothing it lacks, an empty lease.
        (1, 2, [], "not_cached", 2),
    ],
)
def test_pulled_blocks_become_prefix_hits(
    demo_model: Path, peer_blocks: int, puller_blocks: int, wanted: list[int], end: str, cached_blocks: int
) -> None:
    """``lend`` on the peer, ``import_pull`` on the puller: the pulled blocks are the puller's
    prefix-cache hits when its request runs, the fetch is in its pull bandwidth, the lease ends."""
    peer, puller = _engine(demo_model), _engine(demo_model)
    tail = [7] * (BLOCK_SIZE + 5)
    if peer_blocks:
        _serve(peer, "peer", PROMPT[: peer_blocks * BLOCK_SIZE] + tail)
    if puller_blocks:
        _serve(puller, "own", PROMPT[: puller_blocks * BLOCK_SIZE] + [9] * (BLOCK_SIZE + 5))
    hashes = block_hashes(PROMPT, BLOCK_SIZE, model_id=MODEL_ID)[: len(PROMPT) // BLOCK_SIZE]
    missing = puller.missing_blocks(hashes)
    assert missing == list(range(puller_blocks, 5))

    held, got, kv = kv_tiers.lend(peer, "lease", hashes, missing)

    assert (got, held.end) == (wanted, end)
    if kv is None:
        assert not wanted and peer.release_held("lease") == 0
    else:
        assert kv_tiers.import_pull(puller, PROMPT, hashes, got, kv, seconds=0.01) == len(wanted)
        assert puller.load_report().pull_bytes_per_s == pytest.approx(kv.nbytes / 0.01)
        assert peer.release_held("lease") == len(held.block_ids)
    assert _serve(puller, "pulled", PROMPT) == cached_blocks * BLOCK_SIZE


@pytest.mark.slow
def test_a_pull_waits_for_the_peers_step_then_its_bytes(
    demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull requested while the peer is mid-step is leased when that step ends; its request is
    queued on the puller when the bytes have crossed at the profile's pull rate, and hits them."""
    tiers = kv_tiers.TierShape("tenants", 3.0, 2, 48, 4, 6, 1, "cpu")
    shape = kv_tiers.sim_shape(tiers, warmup=0, measured=1)
    setup = next(setup for setup in kv_tiers.SETUPS if setup.name == "host+pulls")
    renderer = PromptRenderer.from_pretrained(demo_model)
    sim = kv_tiers.TierSimulation(shape, tiers, setup, 0, renderer, arrivals=[])
    peer, puller = sim.workers
    # Probed at start, as a real worker's transport probe: the router can price a pull already.
    assert peer.engine.load_report().pull_bytes_per_s == pytest.approx(0.11e9)

    def request(number: int, token_ids: list[int]) -> Request:
        return Request(number, 0, token_ids, block_hashes(token_ids, BLOCK_SIZE, model_id=MODEL_ID), sim.now)

    def run_until(predicate: Callable[[], bool]) -> None:
        for _ in range(10_000):
            if predicate():
                return
            sim.now, _, kind, payload = heapq.heappop(sim.events)
            sim._handle(kind, payload)
        raise AssertionError("the simulation did not get there")

    cached = request(0, PROMPT[: 4 * BLOCK_SIZE] + [7] * 20)
    sim._admit(peer, cached)
    run_until(lambda: len(sim.done) == 1)
    # The peer starts a long prefill; its step ends at step_end.
    sim._admit(peer, request(1, [5] * 600))
    run_until(lambda: peer.clock.now * 1000 > sim.now)
    step_end = peer.clock.now * 1000
    landed: list[kv_tiers.Pull] = []
    land = sim._land

    def record(pull: kv_tiers.Pull) -> None:
        landed.append(pull)
        land(pull)

    monkeypatch.setattr(sim, "_land", record)
    pulled = request(2, PROMPT)
    sim.pull_from = sim._view(peer)
    sim._admit(puller, pulled)
    run_until(lambda: pulled.first_token_ms is not None)

    (pull,) = landed
    assert pull.wanted == [0, 1, 2, 3] and pull.kv is not None
    assert pull.done_ms == pytest.approx(kv_tiers.transfer_done_ms(step_end, pull.kv.nbytes, 0.11))
    assert pulled.first_token_ms is not None and pulled.first_token_ms > pull.done_ms
    assert sim.pulls["pulled"] == 1 and sim.leases["not_cached"] == 1
    run_until(lambda: len(sim.done) == 3)
    assert pulled.num_cached_tokens == 4 * BLOCK_SIZE
    # The fetch, from its decision to the last byte (the wait for the peer's step included), is in
    # the puller's pull bandwidth, below the probe's; the peer's is still the probe's.
    measured = puller.engine.load_report().pull_bytes_per_s
    assert measured is not None and measured < 0.11e9
    assert peer.engine.load_report().pull_bytes_per_s == pytest.approx(0.11e9)


@pytest.mark.parametrize(
    ("is_slow", "host_ratio", "disk_ratio"),
    [(False, 0.08, 0.4), (True, 0.08, 2.0)],
)
def test_mixed_fleet_charges_each_worker_its_ratio(
    is_slow: bool, host_ratio: float, disk_ratio: float
) -> None:
    """A block's modelled restore over its recompute time is the profile's ratio for its worker's disk."""
    slow = kv_tiers.slow_workers(4, 0.5)
    costs = kv_tiers.fleet_costs(ISSUE14_COST, kv_tiers.PROFILES["gpu-ratio"], slow, BLOCK_BYTES, BLOCK_SIZE)
    assert len(costs) == 4
    for cost, worker_slow in zip(costs, slow, strict=True):
        if worker_slow != is_slow:
            continue
        assert cost.step_ms == ISSUE14_COST["step_ms"] and cost.token_ms == ISSUE14_COST["token_ms"]
        recompute = BLOCK_MS / 1000
        assert cost.move_seconds(BLOCK_BYTES, disk=False) / recompute == pytest.approx(host_ratio)
        assert cost.move_seconds(BLOCK_BYTES, disk=True) / recompute == pytest.approx(disk_ratio)


@pytest.mark.slow
def test_mixed_fleet_reports_its_own_restore_costs(demo_model: Path) -> None:
    """Each simulated worker reports the rates its own cost model charges, so the router prices a
    disk block above a recompute on a slow worker and below it on a fast one."""
    tiers = kv_tiers.TierShape("tenants", 3.0, 4, 64, 8, 6, 2, "gpu-ratio", 0.5)
    shape = kv_tiers.sim_shape(tiers, warmup=40, measured=40)
    setup = next(setup for setup in kv_tiers.SETUPS if setup.name == "host+disk")
    simulation = kv_tiers.TierSimulation(shape, tiers, setup, 0, PromptRenderer.from_pretrained(demo_model))
    simulation.run()
    disk = [restore_block_tokens(worker.report, "disk") for worker in simulation.workers]
    host = [restore_block_tokens(worker.report, "host") for worker in simulation.workers]
    assert all(tokens is not None for tokens in disk + host)
    for tokens, worker_slow in zip(disk, simulation.slow, strict=True):
        assert tokens is not None
        assert (tokens > BLOCK_SIZE) if worker_slow else (tokens < BLOCK_SIZE)
    assert all(tokens is not None and tokens < 0.1 * BLOCK_SIZE for tokens in host)
