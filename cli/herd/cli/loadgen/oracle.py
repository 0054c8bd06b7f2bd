"""The oracle: the best prefix-cache hit rate a router could reach on a trace, and the trace's ceiling.

Each worker is modelled as herd's block manager (``herd.worker.block_manager``) serving one request
at a time from a pool of ``blocks_per_worker`` KV blocks:

1. the prompt's hit is the leading run of its full-block hashes (``herd.api.kv_hash``) the worker
   holds, at most ``(prompt_tokens - 1) // block_size`` blocks, since a worker always computes the
   prompt's last token: a prompt of exactly ``k`` blocks hits at most ``k - 1``; usage reports
   ``cached_tokens = hit blocks x block_size``;
2. the request takes fresh blocks for the rest of its prompt, then one by one for the tokens it
   decodes (``output_length - 1`` of them get KV), each from the empty blocks first, else by evicting
   the least recently used cached block;
3. its full blocks are registered (a prompt block whose hash is already cached elsewhere in the pool
   stays unregistered, as on a worker; decoded blocks are the request's own and never hit again);
4. when it ends its blocks are freed tail first, so its leading blocks become the most recently used.

An ideal router knows every worker's pool exactly and ignores load. It takes the requests in trace
order and follows the longest hit (the worker holding the longest leading run of the prompt's blocks)
when that hit covers at least ``follow_share`` of the prompt; a request with no hit worth following
goes to the emptiest worker (most empty blocks). Ties go to the least recently used worker (one never
used first), then to the first. Following every hit (``follow_share = 0``) crowds every new chat onto
the worker that holds the chat template's default system prompt, a block every prompt shares, and
thrashes it while others idle; following only long hits loses short real ones. The oracle is the
best of the family ``FOLLOW_SHARES`` on each trace, on the fleet and on its halves (an ideal router
may leave workers idle, and greedy placement does not always gain from more workers). It is greedy,
not an offline optimum, and with no concurrency no running request pins blocks another one needs.
The ceiling is one pool of unbounded size: every full prompt block seen before hits.

Cost: per request and router, one dict lookup per leading hit block per worker, plus the pool
updates; the oracle runs ``len(FOLLOW_SHARES)`` routers on each of ``log2(n) + 1`` fleet sizes.
Hit rate = cached prompt tokens / prompt tokens, over the whole trace.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from herd.api.kv_hash import BlockHash, block_hashes

__all__ = [
    "FOLLOW_SHARES",
    "BestIdeal",
    "OracleRequest",
    "WorkerPool",
    "best_ideal_hit_rate",
    "ceiling_hit_rate",
    "ideal_hit_rate",
    "oracle_report",
    "oracle_request",
]

FOLLOW_SHARES = (0.0, 0.125, 0.25, 0.5)
"""The ideal routers the oracle tries: the share of a prompt a hit must cover to be followed."""

_BlockKey = BlockHash | tuple[int, int]
"""A registered block: a prompt block's hash, or (request serial, index) for a decoded block."""


@dataclass(frozen=True, slots=True)
class OracleRequest:
    """What the oracle needs of one request: its prompt's full-block hashes and its token counts."""

    block_hashes: tuple[BlockHash, ...]
    num_prompt_tokens: int
    num_output_tokens: int


def oracle_request(
    token_ids: Sequence[int], num_output_tokens: int, *, block_size: int, model_id: str
) -> OracleRequest:
    """The request of a prompt's token ids, hashed exactly as a worker hashes them."""
    hashes = block_hashes(token_ids, block_size, model_id=model_id)
    return OracleRequest(tuple(hashes), len(token_ids), num_output_tokens)


class WorkerPool:
    """One worker's KV pool serving one request at a time; ``num_blocks=None`` is unbounded."""

    def __init__(self, num_blocks: int | None, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cached: OrderedDict[_BlockKey, None] = OrderedDict()
        """The free blocks that keep a hash, least recently used first."""
        self.num_empty = num_blocks
        self._serials = itertools.count()

    def num_hit_blocks(self, request: OracleRequest) -> int:
        limit = (request.num_prompt_tokens - 1) // self.block_size
        for index, block_hash in enumerate(request.block_hashes[:limit]):
            if block_hash not in self.cached:
                return index
        return min(limit, len(request.block_hashes))

    def serve(self, request: OracleRequest) -> int:
        """Run ``request`` through the pool; the number of prompt tokens it found cached."""
        num_hits = self.num_hit_blocks(request)
        for block_hash in request.block_hashes[:num_hits]:
            del self.cached[block_hash]
        table: list[_BlockKey | None] = list(request.block_hashes[:num_hits])
        num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
        self._take(num_prompt_blocks - num_hits, request)
        for block_hash in request.block_hashes[num_hits:]:
            table.append(None if block_hash in self.cached else block_hash)
        num_computed = request.num_prompt_tokens + request.num_output_tokens - 1
        num_blocks = -(-num_computed // self.block_size)
        self._take(num_blocks - num_prompt_blocks, request)
        # Blocks filled by decoded tokens (the prompt's partial block included) are this request's own.
        serial = next(self._serials)
        table += [(serial, index) for index in range(len(table), num_computed // self.block_size)]
        table += [None] * (num_blocks - len(table))
        self._free(table)
        return num_hits * self.block_size

    def _take(self, count: int, request: OracleRequest) -> None:
        if self.num_empty is None or count <= 0:
            return
        if count > self.num_empty + len(self.cached):
            raise ValueError(
                f"a request of {request.num_prompt_tokens} prompt and {request.num_output_tokens} output "
                f"tokens needs more than the {self.num_blocks} blocks of a worker: raise --blocks-per-worker"
            )
        from_empty = min(count, self.num_empty)
        self.num_empty -= from_empty
        for _ in range(count - from_empty):
            self.cached.popitem(last=False)

    def _free(self, table: list[_BlockKey | None]) -> None:
        """Free a finished request's blocks tail first; unregistered ones become empty."""
        for key in reversed(table):
            if key is None:
                if self.num_empty is not None:
                    self.num_empty += 1
            else:
                self.cached[key] = None


def _hit_rate(num_cached: int, requests: Sequence[OracleRequest]) -> float:
    num_prompt = sum(request.num_prompt_tokens for request in requests)
    return num_cached / num_prompt if num_prompt else 0.0


def ideal_hit_rate(
    requests: Sequence[OracleRequest],
    *,
    num_workers: int,
    blocks_per_worker: int,
    block_size: int,
    follow_share: float = 0.0,
) -> float:
    """The hit rate of the ideal router that follows hits covering ``follow_share`` of the prompt,
    over ``num_workers`` pools of ``blocks_per_worker`` blocks."""
    if num_workers < 1 or blocks_per_worker < 1:
        raise ValueError(
            f"the oracle needs at least one worker and one block, got {num_workers} and {blocks_per_worker}"
        )
    pools = [WorkerPool(blocks_per_worker, block_size) for _ in range(num_workers)]
    last_used = [-1] * num_workers
    num_cached = 0
    for step, request in enumerate(requests):
        best = _choose(pools, last_used, request, follow_share)
        num_cached += pools[best].serve(request)
        last_used[best] = step
    return _hit_rate(num_cached, requests)


def _choose(
    pools: list[WorkerPool], last_used: list[int], request: OracleRequest, follow_share: float
) -> int:
    hits = [pool.num_hit_blocks(request) for pool in pools]
    longest = max(hits)
    if longest and longest * pools[0].block_size >= follow_share * request.num_prompt_tokens:
        return max(range(len(pools)), key=lambda w: (hits[w], -last_used[w], -w))
    return max(range(len(pools)), key=lambda w: (pools[w].num_empty or 0, -last_used[w], -w))


@dataclass(frozen=True, slots=True)
class BestIdeal:
    """The ideal router that did best: its hit rate, its follow share, the workers it used."""

    hit_rate: float
    follow_share: float
    num_workers: int


def best_ideal_hit_rate(
    requests: Sequence[OracleRequest], *, num_workers: int, blocks_per_worker: int, block_size: int
) -> BestIdeal:
    """The best ideal router of ``FOLLOW_SHARES`` on the fleet and on its halves (``n``, ``n // 2``, ...
    ``1`` workers: an ideal router may leave workers idle), so a fleet twice as large never scores lower.
    Ties go to more workers, then to the lower share."""
    # With no worker at all, the one size left is 0: ideal_hit_rate refuses it, naming the fix.
    fleet_sizes = [num_workers >> halving for halving in range(num_workers.bit_length())] or [num_workers]
    candidates = [
        BestIdeal(
            ideal_hit_rate(
                requests,
                num_workers=size,
                blocks_per_worker=blocks_per_worker,
                block_size=block_size,
                follow_share=share,
            ),
            share,
            size,
        )
        for size in fleet_sizes
        for share in FOLLOW_SHARES
    ]
    return max(candidates, key=lambda best: (best.hit_rate, best.num_workers, -best.follow_share))


def ceiling_hit_rate(requests: Sequence[OracleRequest], *, block_size: int) -> float:
    """The hit rate of one unbounded cache: every full prompt block seen before hits."""
    pool = WorkerPool(None, block_size)
    return _hit_rate(sum(pool.serve(request) for request in requests), requests)


def oracle_report(
    requests: Sequence[OracleRequest], *, num_workers: int, blocks_per_worker: int, block_size: int
) -> dict[str, int | float]:
    """Both figures with what they were computed for (``herd bench oracle`` prints it as JSON)."""
    best = best_ideal_hit_rate(
        requests, num_workers=num_workers, blocks_per_worker=blocks_per_worker, block_size=block_size
    )
    return {
        "num_requests": len(requests),
        "num_prompt_tokens": sum(request.num_prompt_tokens for request in requests),
        "workers": num_workers,
        "blocks_per_worker": blocks_per_worker,
        "block_size": block_size,
        "oracle_hit_rate": round(best.hit_rate, 4),
        "oracle_follow_share": best.follow_share,
        "oracle_workers_used": best.num_workers,
        "ceiling_hit_rate": round(ceiling_hit_rate(requests, block_size=block_size), 4),
    }
