"""KV-cache aware: the worker where the request costs the least work, every term counted in prompt tokens.

For each candidate ``w`` under the bounded-load cap of ``_load``, with ``n`` the prompt's tokens:

    cost(w)  = cache_weight * (uncached(w) + evicted(w))  +  load_weight * (queued(w) + requests(w) * n / 3)

* ``uncached(w) = n - block_size * matched(w)``: the tokens ``w`` would prefill, ``matched(w)`` being the
  leading run of the prompt's blocks the ``KVIndex`` says it holds (a hit saves the rest), none when
  that run is shorter than ``MIN_RUN_BLOCKS`` (two): a single leading block is a chat template's
  opening, held by every worker that has served a chat, and pricing it made every new chat cheaper
  on a worker already used than on one never used (on 128 simulated workers, trace seed 0, only 57
  served the multi-turn trace; over seeds 0-3 in-flight max/mean 3.50 -> 1.43 and hit rate 94 ->
  109 % of the oracle once it counts as none, ``bench/routing_sim_trace.py``,
  docs/routing-at-scale.md);
* ``evicted(w)``: the cached tokens those new blocks push out of ``w``'s pool once it is full (its
  total blocks less those the index holds for it): a later request misses them, so a prefix copied
  onto a worker with no room costs twice, and onto one with room only its prefill;
* ``queued(w)`` (``WorkerView.queued_prefill_tokens``): the prompt tokens waiting for a prefill on ``w``:
  the uncached tokens of the requests this orchestrator sent it that have no first token yet, or its
  load report's waiting ones if more (the report lags a poll behind, and a burst routed within one
  poll would otherwise all look idle);
* ``requests(w)`` (``WorkerView.num_requests``): the larger of its reported running + waiting and this
  orchestrator's own in-flight count (the report covers other replicas, the count what the report has
  not seen yet), each worth a third of a prompt like this one: the decode work a request in flight
  still adds to ``w``'s steps.

Tiers (``tier_cost``): a prompt block a worker holds only in its host or disk tier is restored, not
computed, so ``uncached(w)`` counts from the end of its leading run over every tier
(``KVIndex.match_tiers``), and a separate term adds what the restores cost:

    restore(w) = host(w) * host_block_tokens(w) + disk(w) * disk_block_tokens(w)

``*_block_tokens(w)`` is one block's restore time in tokens ``w`` could prefill meanwhile, from the rates
``w`` measures and reports (``restore_block_tokens``: prefill tokens a second x a block's bytes / restore
bytes a second); a tier not yet measured counts as a recompute (``block_size``). ``weights`` prices a
tier block at a fixed share of a hit instead (llm-d's 1.0 / 0.8); ``device`` ignores the tiers (the
index's device run only). The eviction term counts the restored blocks too: they take device blocks.

Peer pulls (``peer_pulls``): when a peer ``p`` holds a longer leading run of the prompt on its device
or host tier (``D(p)`` blocks, at least ``MIN_RUN_BLOCKS``, by the index's events, nothing merely
expected: ``PromptMatch.lendable``; the peer restores host blocks onto its device for the lease) than
``w`` holds (``r(w)``, its run in any tier), ``w`` may pull the difference over the KV transfer path
instead of computing it. Each pulled block costs ``pull_block_tokens(w)`` (its prefill rate x a
block's bytes / its measured pull bandwidth), and the lease waits for the peer's step in progress
(``lease_wait_tokens(p)``: its queued prefill, up to its step's token budget, and its decodes), so

    uncached(w) -= max(0, max over p of (D(p) - r(w)) * (block_size - pull_block_tokens(w)) - wait(p))

and the choice weighs three ways to serve the prompt in one unit: compute it, pull it, or go to the
holder (whose queue may cost more). The peers ``p`` are the decision's lenders (``ctx.lenders``:
every healthy worker of the role, so a holder at its in-flight limit, which the choice leaves out,
still lends), and ``pull_source`` names the peer that saves the chosen worker the most
(``best_pull``), the fewest in flight among equals, from the lookup ``select`` priced. A worker
that has not measured its pull bandwidth pulls nothing. The wait is what made pulls cost tail
latency: on 32 simulated workers the lease waited for a busy peer's whole prefill chunk (p90
377-562 ms) to save a few blocks' compute (docs/kv-tiers.md).

Why one unit: the old score weighed a cached share in [0, 1] against a load in [0, 1], so a cached
prefix outweighed any load below the cap, every tenant stayed on one worker until the cap forced a
cold copy onto the other at a busy moment, and the loaded worker's steps slowed everyone on it
(issue 14; docs/routing.md has the measurements). In tokens the trade-off reads directly: moving a
request off its cached worker costs its prefix once (twice on a full pool); staying costs the queue.
A third of a prompt per request is fitted in ``bench/routing_sim.py`` (a quarter to a whole prompt
swept; at the issue's shape it is also about 16 output tokens times the engine's decode step cost per
sequence, 12 prefill tokens). The lowest cost wins; ties go to the fewest in flight, then to the fewest
cached blocks (the emptiest pool), then at random.

Cost: one ``KVIndex.match_tiers`` (``match`` when tier-blind, one more ``match`` with peer pulls;
O(matched blocks x holders); ``decide`` shares them with the strategy, ``RequestContext.kv``), a
pass over the workers for the bounded-load cap, then, from ``BOUND_MIN_WORKERS`` workers on, one
for a lower bound on every cost (the load term plus the prompt less the longest run the worker could
skip, with no eviction or restore), and the full price only for the workers whose bound reaches the
exact cost of the lowest-bound one (``_candidates``): the others can neither win nor tie, so the
choice is that of pricing them all (``test_routing_kv_cache_aware_reference.py`` checks it against
the plain formula). At 1,000 workers in ``bench/routing_decision.py`` about 80 are priced, and a
decision's CPU p50 went from 0.43 to 0.31 ms, its p99 from 1.15 to 0.79 ms
(docs/benchmarks/routing.md). Comprehensions with inline conditionals beat ``map``/``attrgetter``
and per-worker calls; numpy does not help, as turning 1,000 views into arrays costs as much as
scoring them in Python.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from herd.api.crd import TierWeights
from herd.orchestrator.kv_index import KVIndex, PromptMatch, TierRun
from herd.orchestrator.routing._load import bounded_load_cap
from herd.orchestrator.routing._types import PeerPull, RequestContext, RoutingStrategy, WorkerView

__all__ = [
    "BOUND_MIN_WORKERS",
    "LEASE_WAIT_SHARE",
    "MIN_RUN_BLOCKS",
    "REQUEST_SHARE",
    "KVCacheAware",
    "PeerOffer",
    "best_pull",
    "lease_wait_tokens",
]


REQUEST_SHARE = 1 / 3
"""What a request in flight on a worker counts for, as a share of the new prompt's tokens."""

BOUND_MIN_WORKERS = 128
"""From this many workers on, only those whose lower bound can reach the least cost are priced in full
(``_candidates``); below it the bound costs more than it saves and every worker is priced. Measured
on the same decisions (bench/routing_decision.py's fleet): CPU p50 +11 % at 64 workers, -5 % at 128,
-18 % at 256, -25 to -30 % at 1,000."""

MIN_RUN_BLOCKS = 2
"""The shortest leading run, over every tier, that counts as cached (see the module's docstring)."""

LEASE_WAIT_SHARE = 1.0
"""The share of a peer's step in progress a lease is priced at. A lease arriving at a random moment
waits half a step on average, but a whole one at worst, and pricing the whole step cut pulled
requests' tail on 32 simulated workers: TTFT p99 lower than at half a step in all 6 cells at 3x,
p50 within 4 % either way (docs/benchmarks.md, "Peer pulls priced by the peer's step")."""


def lease_wait_tokens(peer: WorkerView) -> float:
    """What a lease on ``peer`` waits for, in prompt tokens, times ``LEASE_WAIT_SHARE``: its step in
    progress, which computes its queued prefill up to its step's token budget (all of it when the
    budget is not reported) and, while it has requests, decodes them: a decode step's measured
    seconds in the tokens it prefills meanwhile (nothing until it measured both). Without the decode
    step, a peer with no prefill queued looked free, and its decode steps made most of what leases
    still waited on the simulated fleet (a median of 89 ms, ``bench/kv_tiers_pull_tail.py``)."""
    queued, budget = peer.queued_prefill_tokens, peer.max_batch_tokens
    prefill = min(queued, budget) if budget else queued
    step, rate = peer.decode_step_s, peer.prefill_tokens_per_s
    decode = step * rate if peer.num_requests and step and rate else 0.0
    return LEASE_WAIT_SHARE * (prefill + decode)


@dataclass(frozen=True, slots=True)
class PeerOffer:
    """A peer that can lend the prompt's first ``num_blocks`` blocks after a lease wait of
    ``wait_tokens`` prompt tokens."""

    peer: WorkerView
    num_blocks: int
    wait_tokens: float


def best_pull(
    own_run: int, pull_block_tokens: float | None, offers: Sequence[PeerOffer], block_size: int
) -> tuple[float, PeerOffer | None]:
    """The prompt tokens a worker holding ``own_run`` leading blocks saves by its best pull, and the
    offer it pulls from; ``(0.0, None)`` when no pull saves anything (a pull not measured yet, or
    one that costs a block's compute or more). ``offers``: longest run first (``_offers``)."""
    if pull_block_tokens is None or pull_block_tokens >= block_size:
        return 0.0, None
    saved, best, per_block = 0.0, None, block_size - pull_block_tokens
    for offer in offers:
        if offer.num_blocks <= own_run:
            break
        if (saving := (offer.num_blocks - own_run) * per_block - offer.wait_tokens) > saved:
            saved, best = saving, offer
    return saved, best


@dataclass(frozen=True, slots=True)
class _Prompt:
    """What the KV index says of one prompt, looked up once a decision."""

    matched: dict[str, int]
    """Each matching worker's leading run: over every tier when they are priced, else the device's."""
    tiers: dict[str, TierRun] | None
    """The runs with their lower-tier blocks, when some worker would restore any (else ``None``)."""
    peer_runs: dict[str, int]
    """Each worker's leading run on its device or host tier by its events, nothing expected: what a
    peer can pull from it (empty unless pulls are priced). A run shorter than ``MIN_RUN_BLOCKS`` is
    left out, as in ``matched``: otherwise every chat's opening block, which the puller holds too but
    ``matched`` prices as uncached, would look worth a pull (on 4 real workers' multi-turn trace 40-43
    pulls a run came back with nothing the puller lacked, each waiting for the peer's step)."""
    offers: tuple[PeerOffer, ...]
    """The peers among the workers worth pulling from, longest run first: each has a shorter lease
    wait than every peer with a longer run (any other saves less than one of these, whatever the
    puller's rates)."""

    @property
    def longest_peer_run(self) -> int:
        return self.offers[0].num_blocks if self.offers else 0

    def own_run(self, worker_id: str) -> int:
        """What a worker need not pull: its run in the priced tiers or on its own device and host."""
        return max(self.matched.get(worker_id, 0), self.peer_runs.get(worker_id, 0))


class KVCacheAware(RoutingStrategy):
    name: ClassVar[str] = "kv_cache_aware"
    needs_tokens: ClassVar[bool] = True

    def __init__(
        self,
        *,
        kv_index: KVIndex,
        load_factor: float,
        cache_weight: float,
        load_weight: float,
        block_size: int,
        rng: random.Random,
        tier_cost: Literal["measured", "weights", "device"] = "measured",
        tier_weights: TierWeights | None = None,
        peer_pulls: bool = False,
    ) -> None:
        self._kv_index = kv_index
        self._tier_cost = tier_cost
        self._peer_pulls = peer_pulls
        weights = tier_weights or TierWeights()
        self._weighted = (block_size * (1 - weights.host), block_size * (1 - weights.disk))
        self._load_factor = load_factor
        self._cache_weight = cache_weight
        self._load_weight = load_weight
        self._block_size = block_size
        self._rng = rng
        self._looked_up: tuple[PromptMatch, Sequence[WorkerView], _Prompt] | None = None
        """The last decision's lookup, by the ``PromptMatch`` and lenders ``decide`` made (``_lookup``)."""

    def select(self, workers: Sequence[WorkerView], ctx: RequestContext) -> WorkerView | None:
        cap = bounded_load_cap(workers, self._load_factor)
        prompt = self._lookup(ctx, workers)
        candidates = (
            workers if len(workers) < BOUND_MIN_WORKERS else self._candidates(workers, ctx, cap, prompt)
        )
        costs = self._costs(candidates, ctx, cap, prompt)
        best = min(costs)
        tied = [worker for worker, cost in zip(candidates, costs, strict=True) if cost == best]
        return tied[0] if len(tied) == 1 else self._emptiest(tied)

    def pull_source(
        self, choice: WorkerView, workers: Sequence[WorkerView], ctx: RequestContext
    ) -> PeerPull | None:
        if not self._peer_pulls or not ctx.block_hashes or choice.pull_block_tokens is None:
            return None
        prompt = self._lookup(ctx, workers)
        own = prompt.own_run(choice.id)
        _, offer = best_pull(own, choice.pull_block_tokens, prompt.offers, self._block_size)
        return None if offer is None else PeerPull(offer.peer, offer.num_blocks)

    def _emptiest(self, tied: Sequence[WorkerView]) -> WorkerView:
        """Among equally cheap workers: the fewest in flight, then the fewest cached blocks (held, and
        expected from requests just routed there, whose events have not arrived), then at random.
        The cached blocks matter on a fleet larger than its load: every idle worker with room costs a
        new prefix the same, and a random pick piles several prefixes on some workers while others
        hold none (the oracle, too, places a new prefix on the emptiest worker)."""
        fewest = min([worker.num_in_flight for worker in tied])
        tied = [worker for worker in tied if worker.num_in_flight == fewest]
        held, expected = self._kv_index.held_blocks(), self._kv_index.expected_blocks()
        sizes = [held.get(worker.id, 0) + expected.get(worker.id, 0) for worker in tied]
        least = min(sizes)
        tied = [worker for worker, size in zip(tied, sizes, strict=True) if size == least]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def _lookup(self, ctx: RequestContext, workers: Sequence[WorkerView]) -> _Prompt:
        """The index's answers for the prompt: those ``decide`` already has, else looked up here;
        with the offers of the lenders (``ctx.lenders``, else ``workers``) that hold a run to lend.

        A decision's ``PromptMatch`` and lenders are its own (``decide`` makes them for each), so the
        lookup is kept by them: ``pull_source`` after ``select`` in one decision reuses what
        ``select`` priced rather than walking the runs and every lender again."""
        kv = ctx.kv
        if kv is None or kv.index is not self._kv_index:
            kv = PromptMatch(self._kv_index, ctx.block_hashes)
        lenders = workers if ctx.lenders is None else ctx.lenders
        if (last := self._looked_up) is not None and last[0] is kv and last[1] is lenders:
            return last[2]
        prompt = self._looked_up_for(kv, lenders)
        self._looked_up = (kv, lenders, prompt)
        return prompt

    def _looked_up_for(self, kv: PromptMatch, workers: Sequence[WorkerView]) -> _Prompt:
        tiers = None
        if self._tier_cost == "device":
            matched = {w: m for w, m in kv.device.items() if m >= MIN_RUN_BLOCKS}
        else:
            runs = {w: run for w, run in kv.tiers.items() if run.length >= MIN_RUN_BLOCKS}
            matched = {worker_id: run.length for worker_id, run in runs.items()}
            if any(run.host or run.disk for run in runs.values()):
                tiers = runs
        lendable: dict[str, int] = {}
        if self._peer_pulls:  # a peer's one-block run is the same opening every worker holds: no pull
            lendable = {w: run for w, run in kv.lendable.items() if run >= MIN_RUN_BLOCKS}
        return _Prompt(matched, tiers, lendable, _offers(workers, lendable))

    def _candidates(
        self, workers: Sequence[WorkerView], ctx: RequestContext, cap: int, prompt: _Prompt
    ) -> list[WorkerView]:
        """The workers that may cost the least, in their order: those whose lower bound on the cost is
        at most the exact cost of the worker with the lowest bound.

        The bound is the load term plus the prompt less the longest run the worker could skip (its
        own, or a peer's it could pull), with no eviction or restore: neither is ever negative, and a
        pulled block costs no less than nothing (the restore and pull costs come from measured rates
        and weights in [0, 1]). It reads one small map per worker, where the exact prefill reads the
        index's counts and prices the tiers and pulls. Floating point rounds monotonically and the
        bound is built as ``_costs`` builds the cost, so it never exceeds it: every worker that ties
        at the least cost is kept.
        """
        num_tokens, block_size, cache = len(ctx.token_ids), self._block_size, self._cache_weight
        floor = cache * (num_tokens - block_size * prompt.longest_peer_run)
        floors = {
            worker_id: cache * (num_tokens - block_size * max(length, prompt.longest_peer_run))
            for worker_id, length in prompt.matched.items()
        }
        bounds = self._loads(workers, ctx, cap, floors, floor)
        upper = self._costs([workers[bounds.index(min(bounds))]], ctx, cap, prompt)[0]
        return [w for w, bound in zip(workers, bounds, strict=True) if bound <= upper]

    def _costs(
        self, workers: Sequence[WorkerView], ctx: RequestContext, cap: int, prompt: _Prompt
    ) -> list[float]:
        """The workers' costs in prompt tokens; ``inf`` for those at the bounded-load cap."""
        cache = self._cache_weight
        loads = self._loads(workers, ctx, cap, {}, 0.0)
        prefill = self._prefill_tokens(workers, ctx, prompt)
        return [cache * tokens + load for tokens, load in zip(prefill, loads, strict=True)]

    def _loads(
        self,
        workers: Sequence[WorkerView],
        ctx: RequestContext,
        cap: int,
        floors: Mapping[str, float],
        floor: float,
    ) -> list[float]:
        """Every worker's load term in prompt tokens plus its entry of ``floors``, ``floor`` without
        one (0.0 adds nothing, exactly); ``inf`` for the workers at the bounded-load cap."""
        per_request, load = len(ctx.token_ids) * REQUEST_SHARE, self._load_weight
        # The view derives both counts once when it is built; this runs for every worker on every
        # request, where each attribute read and call counts.
        return [
            floors.get(w.id, floor) + load * (w.queued_prefill_tokens + per_request * w.num_requests)
            if w.num_in_flight < cap
            else math.inf
            for w in workers
        ]

    def _prefill_tokens(
        self, workers: Sequence[WorkerView], ctx: RequestContext, prompt: _Prompt
    ) -> list[float]:
        """Per worker: the prompt tokens it would compute, plus the cached ones the new blocks would
        evict from its pool (a worker whose pool size is not reported yet evicts none), plus its
        restores from lower tiers in tokens."""
        if prompt.tiers is not None:
            tokens = self._tiered_tokens(workers, ctx, prompt.tiers)
            return self._less_pulls(workers, ctx, tokens, prompt)
        num_tokens, num_blocks, block_size = len(ctx.token_ids), len(ctx.block_hashes), self._block_size
        matched = prompt.matched
        held = self._kv_index.held_blocks()
        # The walrus binds m on the left of the sum, before the eviction term reads it.
        tokens = [
            num_tokens
            - block_size * (m := matched.get(w.id, 0))
            + (
                block_size * e
                if w.num_total_blocks and (e := num_blocks - m - w.num_total_blocks + held.get(w.id, 0)) > 0
                else 0
            )
            for w in workers
        ]
        return self._less_pulls(workers, ctx, tokens, prompt)

    def _less_pulls(
        self, workers: Sequence[WorkerView], ctx: RequestContext, tokens: list[float], prompt: _Prompt
    ) -> list[float]:
        """``tokens`` less what each worker's best pull saves (``best_pull``)."""
        if not prompt.offers:
            return tokens
        offers, block_size = prompt.offers, self._block_size
        return [
            t - best_pull(prompt.own_run(w.id), w.pull_block_tokens, offers, block_size)[0]
            for w, t in zip(workers, tokens, strict=True)
        ]

    def _tiered_tokens(
        self, workers: Sequence[WorkerView], ctx: RequestContext, runs: dict[str, TierRun]
    ) -> list[float]:
        """``_prefill_tokens`` where some worker holds part of the prompt in a lower tier: per matched
        worker once, ``(tokens it computes or restores, device blocks it has)``; then one pass."""
        num_tokens, num_blocks, block_size = len(ctx.token_ids), len(ctx.block_hashes), self._block_size
        held = self._kv_index.held_blocks()
        matched = {
            w.id: (num_tokens - block_size * run.length + self._restore_tokens(w, run), run.device)
            for w in workers
            if (run := runs.get(w.id)) is not None
        }
        cold = (float(num_tokens), 0)
        return [
            (m := matched.get(w.id, cold))[0]
            + (
                block_size * e
                if w.num_total_blocks
                and (e := num_blocks - m[1] - w.num_total_blocks + held.get(w.id, 0)) > 0
                else 0
            )
            for w in workers
        ]

    def _restore_tokens(self, w: WorkerView, run: TierRun) -> float:
        """What restoring ``run``'s lower-tier blocks costs ``w``, in prompt tokens."""
        if self._tier_cost == "weights":
            host, disk = self._weighted
        else:
            host = self._block_size if w.host_block_tokens is None else w.host_block_tokens
            disk = self._block_size if w.disk_block_tokens is None else w.disk_block_tokens
        return run.host * host + run.disk * disk


def _offers(workers: Sequence[WorkerView], lendable: Mapping[str, int]) -> tuple[PeerOffer, ...]:
    """The ``workers`` holding a run in ``lendable`` that no other beats on both its run and its lease
    wait, longest run first; among equal runs and waits, the fewest in flight."""
    if not lendable:
        return ()
    peers = sorted(
        (PeerOffer(w, run, lease_wait_tokens(w)) for w in workers if (run := lendable.get(w.id))),
        key=lambda offer: (-offer.num_blocks, offer.wait_tokens, offer.peer.num_in_flight),
    )
    offers: list[PeerOffer] = []
    for offer in peers:
        if not offers or offer.wait_tokens < offers[-1].wait_tokens:
            offers.append(offer)
    return tuple(offers)
