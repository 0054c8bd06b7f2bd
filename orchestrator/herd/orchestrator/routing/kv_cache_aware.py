"""KV-cache aware: the worker that already holds the longest leading run of the prompt's blocks,
weighed against how busy it is, among the workers under the bounded-load cap.

For each candidate ``w`` (``num_in_flight`` under the cap of ``_load``) out of ``n`` workers:

    score(w) = cache_weight * matched(w) / num_blocks  -  load_weight * load(w)
    load(w)  = ( min(1, requests(w) / scale)  +  min(1, queued(w) / (scale * prompt_tokens))
                 + kv_usage(w) ) / 3
    scale    = ceil(load_factor * (sum of requests + 1) / n)

``matched(w)`` is the leading run the ``KVIndex`` says ``w`` holds (0 when the prompt has no full
block); ``requests(w)`` the larger of its reported running + waiting requests and this
orchestrator's own in-flight count (the report covers other orchestrator replicas, the in-flight
count what the report has not seen yet); ``queued(w)`` the uncached prompt tokens waiting on it.
``scale`` is the bounded-load cap applied to ``requests``: a worker holding that many requests, or
that many prompts like this one in its prefill queue, counts as fully loaded. Both sides of the
score lie in [0, 1], so the weights read as plain trade-offs, and a light load (one request more
than an idle peer) does not outweigh a long cached prefix. The best score wins; ties go to the
fewest in flight, then at random.

Cost: ``KVIndex.match`` (O(matched blocks x holders)) plus four comprehension passes over the
workers. Comprehensions with inline conditionals beat ``map``/``attrgetter`` and per-worker calls;
numpy does not help, as turning 1,000 views into arrays costs as much as scoring them in Python.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import ClassVar

from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.routing._load import bounded_load_cap, least_in_flight
from herd.orchestrator.routing._types import RequestContext, RoutingStrategy, WorkerView

__all__ = ["KVCacheAware"]


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
        rng: random.Random,
    ) -> None:
        self._kv_index = kv_index
        self._load_factor = load_factor
        self._cache_weight = cache_weight
        self._load_weight = load_weight
        self._rng = rng

    def select(self, workers: Sequence[WorkerView], ctx: RequestContext) -> WorkerView | None:
        scores = self._scores(workers, ctx)
        best = max(scores)
        tied = [worker for worker, score in zip(workers, scores, strict=True) if score == best]
        return tied[0] if len(tied) == 1 else least_in_flight(tied, self._rng)

    def _scores(self, workers: Sequence[WorkerView], ctx: RequestContext) -> list[float]:
        """Every worker's score; ``-inf`` for those at the bounded-load cap."""
        cap = bounded_load_cap(workers, self._load_factor)
        matched = self._kv_index.match(ctx.block_hashes) if ctx.block_hashes else {}
        cache_unit = self._cache_weight / len(ctx.block_hashes) if ctx.block_hashes else 0.0
        requests = [
            r if (r := w.num_running + w.num_waiting) > w.num_in_flight else w.num_in_flight for w in workers
        ]
        scale = math.ceil(self._load_factor * (sum(requests) + 1) / len(workers))
        queued_scale = scale * max(len(ctx.token_ids), 1)
        load_unit = self._load_weight / 3
        # Inline conditionals instead of min() or helper calls: a call per worker costs more than the
        # arithmetic, and this runs for every worker on every request.
        return [
            cache_unit * matched.get(w.id, 0)
            - load_unit
            * (
                (r / scale if r < scale else 1.0)
                + (
                    w.num_waiting_prefill_tokens / queued_scale
                    if w.num_waiting_prefill_tokens < queued_scale
                    else 1.0
                )
                + w.kv_usage
            )
            if w.num_in_flight < cap
            else -math.inf
            for w, r in zip(workers, requests, strict=True)
        ]
