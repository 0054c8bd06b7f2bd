"""Issue 20's tier benchmark on a simulated fleet: no tier, a host tier, host and disk, peer pulls,
and routing by restore cost against tier-blind routing and fixed weights, side by side in one run.

Built on ``bench/routing_sim.py``'s discrete-event simulation: every worker is herd's own engine
(scheduler, block manager with its tiers, KV events with their medium, load report with its measured
rates) on the cost-model runner, whose tier moves cost their bytes over the cost model's ``hostGBps``
/ ``diskGBps`` (measured on this machine by ``herd bench calibrate``'s ``measure_tiers``: 6.5 and 0.6
GB/s for the demo model's 720 KiB blocks); every request is routed by the orchestrator's own
``decide`` with kv_cache_aware over a real ``KVIndex`` fed by the workers' events at each 250 ms
poll, and the views carry each worker's restore costs as the registry works them out
(``restore_block_tokens``). What differs between setups is only the tiers and ``tierCost``:

* ``none``: no tier below the device; kv_cache_aware (its tier cost has nothing to price);
* ``host``: ``hostMemoryGiB`` of the working set's share of each worker, tierCost
  measured; ``host, tier-blind`` and ``host, weights 1.0/0.8``: the same workers, tierCost device and
  weights;
* ``host+disk``: a host tier of a quarter of that and a disk tier of ``host``'s size, measured;
  ``host+disk, tier-blind`` and ``host+disk, weights 1.0/0.8``: the same workers, device and weights;
* ``host+pulls``: ``host`` with ``peerPulls``: a worker may pull a prompt's leading blocks from a
  peer's device or host tier (below).

``--setups`` picks some of them (``none`` first: the open loops' rate comes from it).

Tier costs (``--profile``): ``cpu``, this machine's measured bandwidths (above), or ``gpu-ratio``, a
block's restore time over its recompute time as on an H100 serving an 8B model (host 0.08, a local
NVMe 0.4, network storage 2.0: ``PROFILES``), turned into bandwidths for the demo model's block
bytes and the cost model's ``tokenMs``, so that the simulated compute keeps this machine's fitted
costs and only the tiers' prices relative to it change. ``--slow-disk-share`` of the workers,
spread over the fleet, get the slow disk, the rest the fast one: each worker's runner charges its
own rates and reports them as measured, so ``restore_block_tokens`` differs per worker. A tier
move (a restore, or a write on eviction) is charged inside the step that plans it, as the real
engine on this machine does it; the figures also count the disk blocks restored on slow workers.

Peer pulls, as a real worker makes them (``herd.worker.server._remote_prefill``), with the engine's
own methods: when ``decide`` names ``pull_from``, the chosen worker hashes the prompt and finds the
blocks it lacks (``missing_blocks``); the peer, between two of its steps (a lease waits for the
step in progress to end, as on a real worker, and its restores of host blocks hold the peer's next
step), holds the leading run (``hold_cached``) and the missing blocks it holds are read
(``read_blocks``: ``lend``); their bytes then cross the network at the profile's pull bandwidth
(``transfer_done_ms``), the puller records the fetch, from its decision to the last byte, into its
pull bandwidth (``record_pull``) and imports the blocks between its own steps (``write_blocks``:
``import_pull``), and only then queues the request, which finds them cached; the peer releases the
lease between its steps (``release_held``). A lease that holds none of the missing blocks sends the
request on after the hold, to compute them. Each worker starts with the pull bandwidth its transport
probe would measure (``PROBE_BLOCKS`` blocks at the profile's rate), so the router prices pulls from
the start, as a real worker's probe lets it. The figures count pulls by outcome (``pulled``,
``empty``) and leases by why their run ended (``HeldRun.end``), over the whole run, warm-up included.
Pull costs (``--profile``): ``cpu``, 0.11 GB/s, what a pull over loopback HTTP moved on this machine
(22.4 MiB in 0.19-0.23 s, docs/benchmarks/disagg.md: 6.6 ms a 720 KiB block against 33 ms to
recompute it); ``gpu-ratio``, a block pulled in 0.325 of its recompute time, llm-d's published
figure (a 49k-token prefix pulled from a peer in 551 ms against 1,695 ms recomputed).

Traces: ``tenants`` (multi-tenant: herd bench's shared-prefix workload, tenants drawn uniformly, a
system prompt of ``--prefix-blocks`` blocks each plus a 16-32 word user turn) and ``turns``
(multi-turn: sessions of up to ``--max-turns`` turns whose next prompt is the previous one plus its
output plus a new user turn, sessions drawn uniformly; a session that reached its last turn starts
over with a new history; a turn drawn while its session's previous turn is in flight waits for that
answer and is sent when it comes, its TTFT counted from then). The working set is the trace's
distinct prefix blocks (tenants x prefix blocks; sessions x their longest history) over the whole
fleet's device blocks, ``--working-sets`` (1.5 and 3).

Two loops, every round. Closed: ``--concurrency`` requests in flight per worker, each finish sending
the next. Open (``--loads``): requests arrive as a Poisson process at ``F`` x the requests a second
the ``none`` setup served in the same round's closed loop, for each load ``F``; the arrival times
come from the seed alone, so every setup of a round sees the same ones, and a request's TTFT counts
its wait in the worker's queue (as vLLM's ``benchmark_serving --request-rate``). Each round (seeds
0..rounds-1) runs every setup in the closed loop, ``none`` first, then every setup at each load, in
turn; the table gives each figure's median over the rounds and its range. Besides the hit rate,
TTFT and throughput, each run reports the share of requests that hit and the TTFT p50 of hits and
of misses apart (``hit_split``), and the share of decisions that sent a request away from the
worker holding the longest run of its prompt in any tier (``spill_rate``, over the whole run) and
the part of those where every such worker was at the bounded-load cap (``forced_spill_rate``): a
spill that was not forced is the router pricing that worker's queue above recomputing the prefix
elsewhere. Every worker's step takes ``--max-batch-tokens`` tokens at most.

    .venv/bin/python bench/kv_tiers.py --out bench/results/kv_tiers_sim.json
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import random
import shlex
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, get_args

import torch
from pydantic import TypeAdapter
from routing_sim import BLOCK_SIZE, ISSUE14_COST, MODEL_ID, Request, Shape, SimModel, Simulation, SimWorker

from herd.api.crd import RoutingSpec
from herd.api.kv_hash import block_hashes
from herd.api.prompt import PromptRenderer
from herd.api.protocol import KVSnapshot
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.routing import (
    Decision,
    RequestContext,
    WorkerView,
    build_strategy,
    pull_block_tokens,
    restore_block_tokens,
)
from herd.worker.block_manager import HeldRun, RunEnd
from herd.worker.cache_geometry import bytes_per_block
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.kv_transfer import PROBE_BLOCKS, lease_run, lent_blocks
from herd.worker.loader import read_model_args
from herd.worker.outputs import RequestOutput
from herd.worker.simulated_runner import CostModel, VirtualClock, simulated_engine

__all__ = ["main"]

DEMO_MODEL = Path(__file__).resolve().parent.parent / ".cache" / "models" / "smollm2-135m-instruct"


@dataclass(frozen=True)
class TierProfile:
    """What a tier move costs in a fleet: GB a second over the host tier, a fast (local) disk, a
    slow (network) disk and a pull from a peer over the network, given either as measured
    bandwidths (``ratios`` False) or as a block's move time over its recompute time (``ratios``
    True), to be turned into bandwidths for the simulated model's block bytes and prefill cost
    (``bandwidths``)."""

    name: str
    host: float
    disk: float
    slow_disk: float
    pull: float
    ratios: bool

    def bandwidths(self, bytes_per_block: int, block_ms: float) -> tuple[float, float, float, float]:
        """GB a second of the host tier, the fast disk, the slow disk and a peer pull. ``block_ms``:
        what recomputing a block costs (its tokens x the cost model's ``tokenMs``)."""
        if not self.ratios:
            return self.host, self.disk, self.slow_disk, self.pull

        def gbps(ratio: float) -> float:
            return bytes_per_block / (ratio * block_ms / 1000) / 1e9

        return gbps(self.host), gbps(self.disk), gbps(self.slow_disk), gbps(self.pull)


PROFILES = {
    profile.name: profile
    for profile in (
        # This machine (``herd bench calibrate``'s ``measure_tiers`` on the demo model): one disk
        # only; a pull over loopback HTTP moved 22.4 MiB in 0.19-0.23 s (docs/benchmarks/disagg.md).
        TierProfile("cpu", host=6.5, disk=0.6, slow_disk=0.6, pull=0.11, ratios=False),
        # An H100 serving an 8B model in bf16: a 16-token block is 2 MiB of KV and about 1 ms of
        # prefill (~16k tokens/s); host memory over PCIe at ~25 GB/s restores it in 0.08 ms, a local
        # NVMe at ~5 GB/s in 0.4 ms, network storage at ~1 GB/s in 2 ms (docs/kv-tiers.md); a peer
        # pull in 551 / 1,695 of the recompute (llm-d's 49k-token prefix pulled against recomputed).
        TierProfile("gpu-ratio", host=0.08, disk=0.4, slow_disk=2.0, pull=551 / 1695, ratios=True),
    )
}
"""``--profile``: the tier costs a simulated fleet runs on."""


def slow_workers(num_workers: int, share: float) -> list[bool]:
    """Which workers have the slow disk: ``share`` of them, spread evenly over the fleet (worker
    ``i`` is slow when ``(i + 1) x share`` passes a whole number that ``i x share`` did not)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"--slow-disk-share must be in [0, 1], got {share}")
    return [int((i + 1) * share) > int(i * share) for i in range(num_workers)]


def fleet_costs(
    base: dict[str, float], profile: TierProfile, slow: list[bool], bytes_per_block: int, block_size: int
) -> list[CostModel]:
    """Each worker's cost model: the compute costs of ``base`` and the profile's tier bandwidths, the
    slow disk's on the workers ``slow`` marks."""
    host, disk, slow_disk, _ = profile.bandwidths(bytes_per_block, block_size * base["token_ms"])
    return [CostModel(**base, host_gbps=host, disk_gbps=slow_disk if is_slow else disk) for is_slow in slow]


@dataclass(frozen=True)
class Setup:
    name: str
    host_share: float
    disk_share: float
    tier_cost: str
    peer_pulls: bool = False
    """``peerPulls``: a worker may pull a prompt's leading blocks from a peer's device or host tier."""


def lend(
    peer: LLMEngine, lease: str, hashes: list[int], missing: list[int]
) -> tuple[HeldRun, list[int], torch.Tensor | None]:
    """The peer's side of a pull, between its steps: hold the leading run of ``hashes`` up to the
    last ``missing`` one (``hold_cached``), read the missing blocks it holds; the run, their
    indexes and their KV (``None``, the lease released, when it holds none of them)."""
    held = peer.hold_cached(lease, lease_run(hashes, missing))
    wanted = lent_blocks(missing, len(held.block_ids))
    if not wanted:
        peer.release_held(lease)
        return held, [], None
    return held, wanted, peer.read_blocks([held.block_ids[index] for index in wanted])


def import_pull(
    puller: LLMEngine,
    token_ids: list[int],
    hashes: list[int],
    wanted: list[int],
    kv: torch.Tensor,
    seconds: float,
) -> int:
    """The puller's side, between its steps: the fetch's time into its pull bandwidth, the blocks
    into its prefix cache; how many it imported."""
    puller.record_pull(kv.nbytes, seconds)
    size = puller.info.block_size
    tokens = [token_ids[index * size : (index + 1) * size] for index in wanted]
    return puller.write_blocks([hashes[index] for index in wanted], tokens, kv)


def transfer_done_ms(hold_end_ms: float, num_bytes: int, gbps: float) -> float:
    """When a pull's last byte arrives: the lease is held at ``hold_end_ms`` (the peer's step in
    progress ended, its restores for the lease made), then ``num_bytes`` cross at ``gbps``."""
    return hold_end_ms + num_bytes / (gbps * 1e9) * 1000


@dataclass(frozen=True)
class Pull:
    """One peer pull in flight: its lease on ``peer`` and what ``puller`` imports when it lands."""

    puller: SimWorker
    peer: SimWorker
    request: Request
    lease: str
    hashes: list[int]
    wanted: list[int]
    kv: torch.Tensor | None
    started_ms: float
    held_ms: float
    """When the lease was held: the peer's step in progress and the lease's restores ended."""
    done_ms: float


@dataclass(frozen=True)
class TierShape:
    trace: str
    working_set: float
    num_workers: int
    pool_blocks: int
    prefix_blocks: int
    max_turns: int
    concurrency: int
    profile: str = "cpu"
    """The fleet's tier costs, a ``PROFILES`` name."""
    slow_disk_share: float = 0.0
    """The share of the workers whose disk tier is the profile's slow one (``slow_workers``)."""
    max_batch_tokens: int = 1024
    """Each worker's step token budget (``engine.maxBatchTokens``): a prompt longer than it is
    prefilled in chunks, and a request that arrives mid-step waits for the step in progress."""

    def num_streams(self) -> int:
        """Tenants or sessions, so that their distinct blocks are ``working_set`` x the fleet's pool."""
        per_stream = (
            self.prefix_blocks if self.trace == "tenants" else self.prefix_blocks + 3 * self.max_turns
        )
        return max(1, round(self.working_set * self.num_workers * self.pool_blocks / per_stream))


class TierSimulation(Simulation):
    """``Simulation`` with tiered workers, tier-priced routing and a multi-turn trace."""

    def __init__(
        self,
        shape: Shape,
        tiers: TierShape,
        setup: Setup,
        seed: int,
        renderer: PromptRenderer,
        arrivals: list[float] | None = None,
    ) -> None:
        """``arrivals``: the open loop's arrival time of every request in simulated ms (``None``: the
        closed loop of ``shape.concurrency`` requests in flight)."""
        self.tiers, self.setup = tiers, setup
        self.per_block = per_block = demo_bytes_per_block()
        base = {"step_ms": shape.step_ms, "seq_ms": shape.seq_ms, "token_ms": shape.token_ms}
        self.slow = slow_workers(shape.num_workers, tiers.slow_disk_share)
        profile = PROFILES[tiers.profile]
        self.costs = fleet_costs(base, profile, self.slow, per_block, BLOCK_SIZE)
        self.pull_gbps = profile.bandwidths(per_block, BLOCK_SIZE * shape.token_ms)[3]
        share = tiers.working_set * tiers.pool_blocks
        self.host_gib = setup.host_share * share * per_block / 2**30
        self.disk_gib = setup.disk_share * share * per_block / 2**30
        super().__init__(shape, "kv_cache_aware", seed, renderer)
        settings = {
            "strategy": "kv_cache_aware",
            "loadFactor": shape.load_factor,
            "tierCost": setup.tier_cost,
            "peerPulls": setup.peer_pulls,
        }
        spec = TypeAdapter(RoutingSpec).validate_python(settings)
        strategy = build_strategy(spec, kv_index=self.index, block_size=BLOCK_SIZE, rng=random.Random(seed))
        self.model = SimModel(ModelConfig(MODEL_ID, spec, block_size=BLOCK_SIZE), strategy, self.index)
        self.arrivals = arrivals
        self.num_issued = 0
        self.histories: dict[int, list[int]] = {}
        self.num_turns: dict[int, int] = {}
        self.outputs: dict[int, list[int]] = {}
        self.busy_sessions: set[int] = set()
        self.waiting: dict[int, deque[int]] = {}
        """Per session, the turns drawn while its previous turn was in flight, in order."""
        self.between: dict[str, list[Callable[[], None]]] = {}
        """Per worker, what runs before its next step (a lease, an import, a release)."""
        self.pull_from: WorkerView | None = None
        """The peer the decision being applied names, until its request is admitted."""
        self.pulls: collections.Counter[str] = collections.Counter()
        self.leases: collections.Counter[str] = collections.Counter()

    def _worker(self, number: int, renderer: PromptRenderer) -> SimWorker:
        shape, clock = self.shape, VirtualClock()
        kv_cache: dict[str, Any] = {"blockSize": BLOCK_SIZE, "hostMemoryGiB": self.host_gib}
        if self.disk_gib:
            kv_cache["disk"] = {"path": "/nonexistent/simulated", "sizeGiB": self.disk_gib}
        config = EngineConfig(
            model_path=DEMO_MODEL,
            served_name=MODEL_ID,
            engine={"maxBatchTokens": self.tiers.max_batch_tokens, "maxBatchSize": 64, "kvCache": kv_cache},
        )
        engine = simulated_engine(
            config, num_blocks=shape.num_kv_blocks(), cost=self.costs[number], clock=clock, renderer=renderer
        )
        # The transport probe a real worker makes at start, at the profile's pull rate.
        probe_bytes = PROBE_BLOCKS * self.per_block
        engine.record_pull(probe_bytes, probe_bytes / (self.pull_gbps * 1e9))
        worker = SimWorker(f"worker-{number}", engine, clock)
        snapshot = KVSnapshot(epoch=engine.info.epoch, seq=0, block_size=BLOCK_SIZE, block_hashes=[])
        self.index.reset(worker.id, snapshot)
        return worker

    def _view(self, worker: SimWorker) -> WorkerView:
        return replace(
            super()._view(worker),
            host_block_tokens=restore_block_tokens(worker.report, "host"),
            disk_block_tokens=restore_block_tokens(worker.report, "disk"),
            pull_block_tokens=pull_block_tokens(worker.report),
        )

    def _apply(self, decision: Decision) -> None:
        super()._apply(decision)
        self.pull_from = decision.pull_from

    def _admit(self, worker: SimWorker, request: Request) -> None:
        """Queue the request on the worker, or, when its decision named a peer to pull from, start
        the pull: the request is queued when it lands (``_land``)."""
        view, self.pull_from = self.pull_from, None
        hashes = request.hashes[: len(request.token_ids) // BLOCK_SIZE]
        missing = [] if view is None else worker.engine.missing_blocks(hashes)
        if view is None or not missing:
            super()._admit(worker, request)
            return
        peer = next(w for w in self.workers if w.id == view.id)
        started = self.now
        self._between_steps(peer, lambda: self._lend(worker, peer, request, hashes, missing, started))

    def _lend(
        self,
        puller: SimWorker,
        peer: SimWorker,
        request: Request,
        hashes: list[int],
        missing: list[int],
        started_ms: float,
    ) -> None:
        """On the peer, between its steps: the lease, and the transfer of what it holds."""
        lease = f"pull-{request.number}"
        held, wanted, kv = lend(peer.engine, lease, hashes, missing)
        self.leases[held.end] += 1
        if kv is None:
            self.pulls[f"empty_{held.end}"] += 1
        hold_end = peer.clock.now * 1000  # after the restores the lease made
        done = hold_end if kv is None else transfer_done_ms(hold_end, kv.nbytes, self.pull_gbps)
        pull = Pull(puller, peer, request, lease, hashes, wanted, kv, started_ms, hold_end, done)
        self._at(done, "pulled", pull)

    def _land(self, pull: Pull) -> None:
        """On the puller, between its steps: the import (if the lease held any block), then the request."""
        if pull.kv is not None:
            seconds = (pull.done_ms - pull.started_ms) / 1000
            self.pulls["pulled"] += 1
            self.pulls["blocks"] += import_pull(
                pull.puller.engine, pull.request.token_ids, pull.hashes, pull.wanted, pull.kv, seconds
            )
        super()._admit(pull.puller, pull.request)

    def _release(self, pull: Pull) -> None:
        """On the peer, between its steps: the lease ends."""
        pull.peer.engine.release_held(pull.lease)

    def _between_steps(self, worker: SimWorker, action: Callable[[], None]) -> None:
        """Run ``action`` on the worker when its step in progress ends (now if it is idle)."""
        self.between.setdefault(worker.id, []).append(action)
        if not worker.busy:
            worker.busy = True
            self._at(self.now, "step", worker)

    def _step(self, worker: SimWorker) -> None:
        """What waits for this pause first; when its tier moves took time, the step starts after them."""
        if actions := self.between.pop(worker.id, None):
            worker.clock.now = self.now / 1000
            for action in actions:
                action()
            if worker.clock.now * 1000 > self.now:
                self._at(worker.clock.now * 1000, "step", worker)
                return
        super()._step(worker)
        if not worker.busy and worker.id in self.between:
            worker.busy = True
            self._at(self.now, "step", worker)

    def run(self) -> dict[str, Any]:
        if self.arrivals is None:
            return super().run()
        for number, when in enumerate(self.arrivals[: len(self.turns)]):
            self._at(when, "arrive", number)
        self._run_until(len(self.turns))
        first, end = self.shape.warmup, self.shape.warmup + self.shape.measured
        return self._summary([request for request in self.done if first <= request.number < end])

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "arrive":
            self._issue()
        elif kind == "pulled":
            pull: Pull = payload
            if pull.kv is not None:
                self._between_steps(pull.peer, lambda: self._release(pull))
            self._between_steps(pull.puller, lambda: self._land(pull))
        else:
            super()._handle(kind, payload)

    def _send(self) -> None:
        """The closed loop's next request (each finish calls it); the open loop's come on arrival."""
        if self.arrivals is None:
            self._issue()

    def _issue(self) -> None:
        """The next request of the trace arrives: sent now, or for a chat turn whose session still
        waits for its previous answer, once that answer is in (its TTFT counts from then)."""
        if self.num_issued >= len(self.turns):
            return
        number = self.num_issued
        self.num_issued += 1
        if self.tiers.trace == "tenants":
            super()._send()  # sends self.turns[self.num_sent], and num_sent == number here
            return
        session = self.turns[number][0]
        if session in self.busy_sessions:
            self.waiting.setdefault(session, deque()).append(number)
        else:
            self._send_turn(number)

    def _send_turn(self, number: int) -> None:
        session, num_words = self.turns[number]
        if self.num_turns.get(session, 0) >= self.tiers.max_turns or session not in self.histories:
            self.histories[session] = random.Random(1_000_003 * session).choices(
                range(49152), k=self._prefix_len()
            )
            self.num_turns[session] = 0
        user = random.Random(number).choices(range(49152), k=num_words + 9)
        token_ids = self.histories[session] + user
        request = Request(
            number,
            session,
            token_ids,
            block_hashes(token_ids, BLOCK_SIZE, model_id=MODEL_ID),
            self.now,
        )
        self.num_sent += 1
        self.busy_sessions.add(session)
        self._admit(self._route(request), request)

    def _held(self, hashes: list[int]) -> dict[str, int]:
        """Each worker's leading run in any tier: a host block is a hit the router may go for."""
        return {worker_id: run.length for worker_id, run in self.index.match_tiers(hashes).items()}

    def _record(self, worker: SimWorker, output: RequestOutput, finish_ms: float) -> None:
        request = worker.requests[output.request_id]
        self.outputs.setdefault(request.number, []).extend(output.new_token_ids)
        if output.finished and self.tiers.trace == "turns":
            self.histories[request.tenant] = request.token_ids + self.outputs.pop(request.number)
            self.num_turns[request.tenant] = self.num_turns.get(request.tenant, 0) + 1
        super()._record(worker, output, finish_ms)

    def _finish(self, worker: SimWorker, request: Request) -> None:
        super()._finish(worker, request)
        if self.tiers.trace == "turns":
            self.busy_sessions.discard(request.tenant)
            if waiting := self.waiting.get(request.tenant):
                self._send_turn(waiting.popleft())

    def _context(self, request: Request) -> RequestContext:
        return RequestContext(model=MODEL_ID, token_ids=request.token_ids, block_hashes=request.hashes)

    def _num_duplicated(self) -> int:
        return 0

    def _summary(self, measured: list[Request]) -> dict[str, Any]:
        summary = super()._summary(measured)
        counters = [worker.engine.block_manager.counters for worker in self.workers]
        summary["restored_host"] = sum(c.restored["host"] for c in counters)
        summary["restored_disk"] = sum(c.restored["disk"] for c in counters)
        summary["restored_disk_slow"] = sum(
            c.restored["disk"] for c, slow in zip(counters, self.slow, strict=True) if slow
        )
        summary.update(hit_split(measured))
        summary["pulls_pulled"] = self.pulls["pulled"]
        summary["pulled_blocks"] = self.pulls["blocks"]
        summary["pulls_empty"] = sum(self.pulls[f"empty_{end}"] for end in RUN_ENDS)
        for end in RUN_ENDS:
            summary[f"leases_{end}"] = self.leases[end]
            summary[f"empty_{end}"] = self.pulls[f"empty_{end}"]
        return {
            key: summary[key]
            for key in (
                "hit_rate",
                "ttft_p50_ms",
                "ttft_p99_ms",
                "requests_per_s",
                "hit_requests",
                "ttft_p50_hit_ms",
                "ttft_p50_miss_ms",
                "spill_rate",
                "forced_spill_rate",
                "restored_host",
                "restored_disk",
                "restored_disk_slow",
                "pulls_pulled",
                "pulled_blocks",
                "pulls_empty",
                *(f"leases_{end}" for end in RUN_ENDS),
                *(f"empty_{end}" for end in RUN_ENDS),
            )
        }


def hit_split(measured: list[Request]) -> dict[str, float]:
    """The share of requests that hit (at least half their prompt cached) and the TTFT p50 of the
    hits and of the misses apart: TTFT is bimodal, so the p50 of all moves only once most hit."""
    hits = [r for r in measured if 2 * r.num_cached_tokens >= len(r.token_ids)]
    misses = [r for r in measured if 2 * r.num_cached_tokens < len(r.token_ids)]

    def p50(requests: list[Request]) -> float:
        return statistics.median((r.first_token_ms or 0.0) - r.sent_ms for r in requests) if requests else 0.0

    return {
        "hit_requests": len(hits) / len(measured),
        "ttft_p50_hit_ms": p50(hits),
        "ttft_p50_miss_ms": p50(misses),
    }


RUN_ENDS: tuple[str, ...] = get_args(RunEnd)
"""Why a lease's run ended (``HeldRun.end``), in the order the figures list them."""


def demo_bytes_per_block() -> int:
    """A block's bytes of the demo model's fp32 KV (720 KiB)."""
    return bytes_per_block(read_model_args(DEMO_MODEL), BLOCK_SIZE, torch.float32)


SETUPS = [
    Setup("none", 0.0, 0.0, "measured"),
    Setup("host", 1.0, 0.0, "measured"),
    Setup("host+disk", 0.25, 1.0, "measured"),
    Setup("host+pulls", 1.0, 0.0, "measured", peer_pulls=True),
    Setup("host, tier-blind", 1.0, 0.0, "device"),
    Setup("host, weights 1.0/0.8", 1.0, 0.0, "weights"),
    Setup("host+disk, tier-blind", 0.25, 1.0, "device"),
    Setup("host+disk, weights 1.0/0.8", 0.25, 1.0, "weights"),
]


def poisson_arrivals(rate_per_s: float, count: int, seed: int) -> list[float]:
    """``count`` arrival times in simulated ms of a Poisson process at ``rate_per_s``, the same for a
    seed whatever the setup."""
    rng = random.Random(f"arrivals-{seed}")
    return list(itertools.accumulate(rng.expovariate(rate_per_s / 1000) for _ in range(count)))


def sim_shape(tiers: TierShape, warmup: int, measured: int) -> Shape:
    """The routing simulation's shape for ``tiers``: the demo model's fitted compute costs."""
    return Shape(
        num_tenants=tiers.num_streams(),
        prefix_blocks=tiers.prefix_blocks,
        pool_blocks=tiers.pool_blocks,
        output_tokens=8,
        concurrency=tiers.concurrency * tiers.num_workers,
        num_workers=tiers.num_workers,
        warmup=warmup,
        measured=measured,
        **ISSUE14_COST,
    )


def run(
    tiers: TierShape,
    setups: list[Setup],
    rounds: int,
    warmup: int,
    measured: int,
    loads: list[float],
) -> dict[str, Any]:
    """Each round (seed): every setup in the closed loop, ``none`` first; then for each load ``F``
    every setup in the open loop at ``F`` x that round's closed-loop ``none`` throughput, all setups
    on the same arrival times."""
    if setups[0].name != "none":
        raise ValueError("the open loop's rate comes from the none setup: it must run first")
    renderer = PromptRenderer.from_pretrained(DEMO_MODEL)
    streams = tiers.num_streams()
    shape = sim_shape(tiers, warmup, measured)
    labels = ["closed", *(f"open {load:g}" for load in loads)]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        label: {setup.name: [] for setup in setups} for label in labels
    }
    rates: dict[str, list[float]] = {label: [] for label in labels[1:]}
    count = warmup + measured + shape.concurrency
    for seed in range(rounds):
        for label in labels:
            arrivals = None
            if label != "closed":
                load = loads[labels.index(label) - 1]
                rate = load * runs["closed"]["none"][seed]["requests_per_s"]
                rates[label].append(round(rate, 3))
                arrivals = poisson_arrivals(rate, count, seed)
            for setup in setups:
                started = time.perf_counter()
                result = TierSimulation(shape, tiers, setup, seed, renderer, arrivals).run()
                runs[label][setup.name].append(result)
                print(
                    f"  {tiers.trace} {tiers.working_set}x {label} seed {seed} {setup.name}: {result} "
                    f"({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
    loops = {
        label: {"rates_per_s": rates.get(label), "setups": _table(by_setup), "runs": by_setup}
        for label, by_setup in runs.items()
    }
    return {"shape": {**vars(tiers), "streams": streams}, "loops": loops}


def _table(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Each setup's figures over the rounds: median, min and max."""
    return {
        name: {
            key: {
                "median": round(statistics.median(r[key] for r in results), 4),
                "min": round(min(r[key] for r in results), 4),
                "max": round(max(r[key] for r in results), 4),
            }
            for key in results[0]
        }
        for name, results in runs.items()
    }


def print_table(result: dict[str, Any]) -> None:
    shape = result["shape"]
    for label, loop in result["loops"].items():
        rates = "" if loop["rates_per_s"] is None else f", offered {loop['rates_per_s']} req/s by round"
        print(
            f"\n{shape['trace']} at {shape['working_set']}x the fleet's device pool, {label} loop, "
            f"tier profile {shape['profile']}, slow disks {shape['slow_disk_share']:g} "
            f"({shape['streams']} streams, {shape['num_workers']} workers x {shape['pool_blocks']} blocks{rates})"
        )
        print(
            "| setup | hit rate | TTFT p50 (sim ms) | TTFT p99 (sim ms) | req/s "
            "| requests hit (TTFT p50 hit / miss) | spilled (forced) "
            "| restored host / disk (on slow disks) | pulls with blocks / empty (blocks pulled) "
            "| leases by end (empty) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for name, row in loop["setups"].items():
            cells = [
                f"{row[key]['median']:.3g} ({row[key]['min']:.3g}-{row[key]['max']:.3g})"
                for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms", "requests_per_s")
            ]
            split = (
                f"{row['hit_requests']['median']:.2f} ({row['ttft_p50_hit_ms']['median']:.0f} / "
                f"{row['ttft_p50_miss_ms']['median']:.0f})"
            )
            spilled = f"{row['spill_rate']['median']:.2f} ({row['forced_spill_rate']['median']:.2f})"
            restored = (
                f"{row['restored_host']['median']:.0f} / {row['restored_disk']['median']:.0f} "
                f"({row['restored_disk_slow']['median']:.0f})"
            )
            pulls = (
                f"{row['pulls_pulled']['median']:.0f} / {row['pulls_empty']['median']:.0f} "
                f"({row['pulled_blocks']['median']:.0f})"
            )
            leases = ", ".join(
                f"{end} {row[f'leases_{end}']['median']:.0f} ({row[f'empty_{end}']['median']:.0f})"
                for end in RUN_ENDS
                if row[f"leases_{end}"]["max"]
            )
            print(
                f"| {name} | {' | '.join(cells)} | {split} | {spilled} | {restored} | {pulls} | {leases or '-'} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--pool-blocks", type=int, default=64, help="each worker's device pool")
    parser.add_argument("--prefix-blocks", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight per worker")
    parser.add_argument("--working-sets", type=float, nargs="+", default=[1.5, 3.0])
    parser.add_argument("--traces", nargs="+", default=["tenants", "turns"], choices=["tenants", "turns"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1500)
    parser.add_argument("--measured", type=int, default=1500)
    parser.add_argument(
        "--loads",
        type=float,
        nargs="*",
        default=[0.8, 0.95],
        help="open-loop rates, as shares of the round's closed-loop throughput with no tier",
    )
    parser.add_argument(
        "--setups",
        nargs="+",
        default=[setup.name for setup in SETUPS],
        choices=[setup.name for setup in SETUPS],
        help="the setups to run, in this order; none first (the open loops' rate comes from it)",
    )
    parser.add_argument(
        "--profile",
        default="cpu",
        choices=sorted(PROFILES),
        help="tier costs: cpu (this machine's measured bandwidths) or gpu-ratio (an H100 serving an 8B "
        "model's restore-to-recompute ratios, turned into bandwidths for the demo model's blocks)",
    )
    parser.add_argument(
        "--slow-disk-share",
        type=float,
        default=0.0,
        help="the share of the workers whose disk tier is the profile's slow one (network storage)",
    )
    parser.add_argument(
        "--max-batch-tokens", type=int, default=1024, help="each worker's step token budget (chunked prefill)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    by_name = {setup.name: setup for setup in SETUPS}
    setups = [by_name[name] for name in args.setups]
    results = []
    for trace in args.traces:
        for working_set in args.working_sets:
            tiers = TierShape(
                trace,
                working_set,
                args.workers,
                args.pool_blocks,
                args.prefix_blocks,
                args.max_turns,
                args.concurrency,
                args.profile,
                args.slow_disk_share,
                args.max_batch_tokens,
            )
            result = run(tiers, setups, args.rounds, args.warmup, args.measured, args.loads)
            print_table(result)
            results.append(result)
    if args.out is not None:
        command = shlex.join(["python", "bench/kv_tiers.py", *(argv if argv is not None else sys.argv[1:])])
        args.out.write_text(
            json.dumps({"benchmark": "kv_tiers", "command": command, "results": results}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
