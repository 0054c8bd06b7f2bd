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

Peer pulls (``peer_pulls``): when another worker's device or host tier holds a longer leading run of
the prompt (``D`` blocks, at least ``MIN_RUN_BLOCKS``, by the index's events, nothing merely expected:
``PromptMatch.lendable``; the peer restores host blocks onto its device for the lease) than ``w``
holds in any tier (``r(w)``),
``w`` may pull the difference over the KV transfer path instead of computing it. Each pulled block
costs ``pull_block_tokens(w)`` (its prefill rate x a block's bytes / its measured pull bandwidth), so

    uncached(w) -= (D - r(w)) * (block_size - pull_block_tokens(w))   when pull_block_tokens(w) < block_size

and the choice weighs three ways to serve the prompt in one unit: compute it, pull it, or go to the
holder (whose queue may cost more). ``pull_source`` then names the peer for the chosen worker: the
longest device run, the fewest in flight among equals. A worker that has not measured its pull
bandwidth pulls nothing.

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

__all__ = ["BOUND_MIN_WORKERS", "MIN_RUN_BLOCKS", "REQUEST_SHARE", "KVCacheAware", "num_pull_blocks"]


REQUEST_SHARE = 1 / 3
"""What a request in flight on a worker counts for, as a share of the new prompt's tokens."""

BOUND_MIN_WORKERS = 128
"""From this many workers on, only those whose lower bound can reach the least cost are priced in full
(``_candidates``); below it the bound costs more than it saves and every worker is priced. Measured
on the same decisions (bench/routing_decision.py's fleet): CPU p50 +11 % at 64 workers, -5 % at 128,
-18 % at 256, -25 to -30 % at 1,000."""

MIN_RUN_BLOCKS = 2
"""The shortest leading run, over every tier, that counts as cached (see the module's docstring)."""


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

    @property
    def longest_peer_run(self) -> int:
        return max(self.peer_runs.values(), default=0)


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

    def select(self, workers: Sequence[WorkerView], ctx: RequestContext) -> WorkerView | None:
        cap = bounded_load_cap(workers, self._load_factor)
        prompt = self._lookup(ctx)
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
        prompt = self._lookup(ctx)
        held, own = prompt.peer_runs, prompt.matched.get(choice.id, 0)
        peers = [w for w in workers if w.id != choice.id and held.get(w.id, 0) > own]
        if not peers:
            return None
        peer = max(peers, key=lambda w: (held[w.id], -w.num_in_flight))
        if not num_pull_blocks(own, held[peer.id], choice.pull_block_tokens, self._block_size):
            return None
        return PeerPull(peer, held[peer.id])

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

    def _lookup(self, ctx: RequestContext) -> _Prompt:
        """The index's answers for the prompt: those ``decide`` already has, else looked up here."""
        kv = ctx.kv
        if kv is None or kv.index is not self._kv_index:
            kv = PromptMatch(self._kv_index, ctx.block_hashes)
        tiers = None
        if self._tier_cost == "device":
            matched = {w: m for w, m in kv.device.items() if m >= MIN_RUN_BLOCKS}
        else:
            runs = {w: run for w, run in kv.tiers.items() if run.length >= MIN_RUN_BLOCKS}
            matched = {worker_id: run.length for worker_id, run in runs.items()}
            if any(run.host or run.disk for run in runs.values()):
                tiers = runs
        lendable = {}
        if self._peer_pulls:  # a peer's one-block run is the same opening every worker holds: no pull
            lendable = {w: run for w, run in kv.lendable.items() if run >= MIN_RUN_BLOCKS}
        return _Prompt(matched, tiers, lendable)

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
        """``tokens`` less what pulling the longest peer run saves each worker whose measured pull is
        cheaper than computing."""
        if not self._peer_pulls or not ctx.block_hashes:
            return tokens
        best, runs, block_size = prompt.longest_peer_run, prompt.matched, self._block_size
        return [
            t - n * (block_size - w.pull_block_tokens)
            if w.pull_block_tokens is not None
            and (n := num_pull_blocks(runs.get(w.id, 0), best, w.pull_block_tokens, block_size))
            else t
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


def num_pull_blocks(own_run: int, peer_run: int, pull_block_tokens: float | None, block_size: int) -> int:
    """Blocks a worker holding ``own_run`` leading blocks should pull from a peer holding
    ``peer_run``: all it lacks when a pulled block costs fewer prefill tokens than computing it
    (``block_size``), else none (a pull not measured yet included)."""
    if pull_block_tokens is None or pull_block_tokens >= block_size or peer_run <= own_run:
        return 0
    return peer_run - own_run
