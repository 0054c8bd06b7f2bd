"""Disaggregated serving: choose a (prefill, decode) pair and run the prefill phase before decode.

For a model with ``serving.mode: disaggregated`` the gateway asks ``TwoPhase.plan`` first:

1. The decode worker is chosen by the model's strategy over the decode pool (its load, and with
   ``kv_cache_aware`` its cached prefix), with ``RequestContext.phase = "decode"``.
2. The prompt's uncached part on that worker (prompt tokens minus its cached leading blocks, from
   the KV index) and the prefill work queued on the best prefill worker decide the path
   (``choose_path``): from ``serving.prefillThresholdTokens`` on, always the prefill pool; shorter
   parts of a few blocks go there while that worker's queue, with them, stays within the
   threshold; the rest prefill on the decode worker.
3. Otherwise the prefill worker with the most of the prompt cached against the least queued
   prefill work runs ``POST /internal/prefill`` and returns ``kv_transfer_params``; a prefill worker
   that fails is reported and the next one is tried, and when none succeeds the decode worker
   prefills locally.
4. The gateway sends the request, with those ``kv_transfer_params``, to the chosen decode worker
   (others on retry); the decode worker pulls the blocks it lacks and streams the tokens back.

Per-phase timings go to ``herd_router_phase_seconds`` and to one log line per request.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from prometheus_client import CollectorRegistry, Histogram

from herd.api import metrics as names
from herd.api.protocol import INTERNAL_PATHS
from herd.orchestrator.breaker import Outcome, answer_outcome
from herd.orchestrator.registry import Registry
from herd.orchestrator.routing import RequestContext, WorkerView, healthy
from herd.orchestrator.served import ServedModel

__all__ = [
    "MIN_REMOTE_BLOCKS",
    "Handoff",
    "TwoPhase",
    "choose_path",
    "choose_prefill",
    "num_uncached_tokens",
    "queued_prefill_tokens",
]

log = logging.getLogger(__name__)

_PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

Path = Literal["remote_prefill", "local_prefill"]


@dataclass(frozen=True, slots=True)
class Handoff:
    """What the decode phase sends: the body (with ``kv_transfer_params`` on the remote path)."""

    body: bytes
    path: Path
    decode_worker_id: str | None = None
    prefill_seconds: float = 0.0
    params: Mapping[str, Any] | None = None
    """The prefill worker's ``kv_transfer_params`` (remote path only)."""


def num_uncached_tokens(num_tokens: int, num_cached_blocks: int, block_size: int) -> int:
    return max(0, num_tokens - num_cached_blocks * block_size)


MIN_REMOTE_BLOCKS = 4
"""Below this many uncached blocks a prompt prefills on its decode worker even beside an idle
prefill pool: a short local chunk costs the decode batch less than a round trip adds to TTFT."""


def queued_prefill_tokens(worker: WorkerView, in_flight_tokens: Mapping[str, int]) -> int:
    """The prefill work ahead of a new prompt on ``worker``: the uncached tokens of the prefills
    this orchestrator has in flight there, or the waiting ones of its last load report if more (the
    report lags and leaves out the prompt being computed; the count misses other orchestrators)."""
    return max(in_flight_tokens.get(worker.id, 0), worker.num_waiting_prefill_tokens)


def choose_path(
    num_uncached: int,
    prefill: WorkerView | None,
    *,
    queued_tokens: int,
    threshold_tokens: int,
    block_size: int,
) -> Path:
    """Where a prompt's uncached part is computed (conditional disaggregation).

    - no prefill worker: locally on the decode worker;
    - at least ``threshold_tokens``: on ``prefill``, whatever its queue (a long local prefill
      would stall every decode on the decode worker, which is what disaggregation avoids);
    - shorter, but ``MIN_REMOTE_BLOCKS`` blocks or more: on ``prefill`` while ``queued_tokens``
      there plus this prompt stay within ``threshold_tokens``, so it waits there no longer than
      for a prompt the decode worker would prefill itself, and a burst of short prompts is shared
      between the two workers instead of piling onto the decode worker's steps;
    - otherwise locally.
    """
    if prefill is None:
        return "local_prefill"
    if num_uncached >= threshold_tokens:
        return "remote_prefill"
    if num_uncached >= MIN_REMOTE_BLOCKS * block_size and queued_tokens + num_uncached <= threshold_tokens:
        return "remote_prefill"
    return "local_prefill"


def choose_prefill(
    workers: Sequence[WorkerView],
    cached_blocks: Mapping[str, int],
    block_size: int,
    in_flight_tokens: Mapping[str, int],
) -> WorkerView | None:
    """The worker with the least prefill work for this prompt: queued tokens (``queued_prefill_tokens``)
    minus its cached prefix.

    Ties go to fewer requests in flight from this orchestrator, then to the id (stable).
    """
    if not workers:
        return None
    return min(
        workers,
        key=lambda worker: (
            queued_prefill_tokens(worker, in_flight_tokens) - cached_blocks.get(worker.id, 0) * block_size,
            worker.num_in_flight,
            worker.id,
        ),
    )


class TwoPhase:
    """Plans and runs the prefill phase of disaggregated requests (see the module docstring)."""

    def __init__(
        self,
        registry: Registry,
        http: httpx.AsyncClient,
        metrics: CollectorRegistry,
        *,
        max_attempts: int = 3,
    ) -> None:
        self.registry = registry
        self.http = http
        self.max_attempts = max_attempts
        self.timeout = httpx.Timeout(600.0, connect=2.0)
        self._prefill_tokens: collections.Counter[str] = collections.Counter()
        """Uncached prompt tokens of the prefills in flight, per prefill worker."""
        self.phase_seconds = Histogram(
            names.HERD_ROUTER_PHASE_SECONDS,
            "Time per phase of disaggregated requests (prefill; decode up to its first byte).",
            ["model", "phase"],
            buckets=_PHASE_BUCKETS,
            registry=metrics,
        )

    async def plan(
        self, served: ServedModel, ctx: RequestContext, payload: dict[str, Any], body: bytes
    ) -> Handoff:
        decode = self._choose_decode(served, ctx)
        if decode is None:
            return Handoff(body, "local_prefill")
        tokens = ctx.token_ids or None  # none while the model's tokenizer is not known yet
        matches: Mapping[str, int] = {}
        if tokens is not None:
            config = served.config
            matches = served.kv_index.match(ctx.block_hashes)
            uncached = num_uncached_tokens(len(tokens), matches.get(decode.id, 0), config.block_size)
            prefill = choose_prefill(
                self._prefill_views(served), matches, config.block_size, self._prefill_tokens
            )
            path = choose_path(
                uncached,
                prefill,
                queued_tokens=0 if prefill is None else queued_prefill_tokens(prefill, self._prefill_tokens),
                threshold_tokens=config.prefill_threshold_tokens,
                block_size=config.block_size,
            )
            if path == "local_prefill":
                return Handoff(body, "local_prefill", decode.id)
        started = time.perf_counter()
        params = await self._prefill(served, payload, matches, 0 if tokens is None else len(tokens))
        if params is None:
            return Handoff(body, "local_prefill", decode.id)
        seconds = time.perf_counter() - started
        self.phase_seconds.labels(served.name, "prefill").observe(seconds)
        log.info(
            "prefilled remotely",
            extra={
                "model": served.name,
                "decode_worker": decode.id,
                "num_blocks": len(params.get("remote_block_hashes") or ()),
                "prefill_seconds": round(seconds, 6),
            },
        )
        handed = json.dumps({**payload, "kv_transfer_params": params}).encode()
        return Handoff(handed, "remote_prefill", decode.id, seconds, params)

    async def release(self, handoff: Handoff) -> None:
        """End the lease of a handoff no decode worker took (best effort: leases also expire)."""
        params = handoff.params
        if params is None or not params.get("remote_host") or not params.get("remote_port"):
            return
        url = f"http://{params['remote_host']}:{params['remote_port']}{INTERNAL_PATHS.kv_release}"
        body = {"remote_request_id": params.get("remote_request_id")}
        try:
            await self.http.post(url, json=body, headers=self.registry.client.headers, timeout=self.timeout)
        except httpx.HTTPError as error:
            log.warning("could not release a KV lease; it will expire", extra={"error": str(error)})

    def observe_decode(self, served: ServedModel, seconds: float) -> None:
        """The decode phase up to its first byte (the KV pull included)."""
        self.phase_seconds.labels(served.name, "decode").observe(seconds)

    def _choose_decode(self, served: ServedModel, ctx: RequestContext) -> WorkerView | None:
        limit = served.config.max_in_flight_per_worker
        views = healthy(self.registry.views(served.name))
        open_views = [view for view in views if not limit or view.num_in_flight < limit]
        if not open_views:
            return None
        return served.strategy.select(open_views, dataclasses.replace(ctx, phase="decode"))

    async def _prefill(
        self, served: ServedModel, payload: dict[str, Any], matches: Mapping[str, int], num_tokens: int
    ) -> dict[str, Any] | None:
        """Run the prefill on the best prefill worker, the next on failure; ``None`` if none did."""
        tried: set[str] = set()
        block_size = served.config.block_size
        for _ in range(self.max_attempts):
            views = [view for view in self._prefill_views(served) if view.id not in tried]
            worker = choose_prefill(views, matches, block_size, self._prefill_tokens)
            if worker is None:
                break
            tried.add(worker.id)
            work = num_uncached_tokens(num_tokens, matches.get(worker.id, 0), block_size)
            params = await self._prefill_on(worker, payload, work)
            if params is not None:
                return params
        log.warning(
            "no prefill worker succeeded; the decode worker prefills locally", extra={"model": served.name}
        )
        return None

    def _prefill_views(self, served: ServedModel) -> list[WorkerView]:
        workers, now = self.registry.model_workers(served.name), time.monotonic()
        return healthy([worker.view(now) for worker in workers if worker.endpoint.role == "prefill"])

    async def _prefill_on(
        self, worker: WorkerView, payload: dict[str, Any], work: int
    ) -> dict[str, Any] | None:
        endpoint = self.registry.workers[worker.id].endpoint
        body = {**payload, "kv_transfer_params": {"do_remote_decode": True}}
        self.registry.begin(worker.id)
        self._prefill_tokens[worker.id] += work
        outcome: Outcome = "none"
        try:
            response = await self.http.post(
                endpoint.internal_url + INTERNAL_PATHS.prefill,
                json=body,
                headers=self.registry.client.headers,
                timeout=self.timeout,
            )
            outcome = answer_outcome(response.status_code, has_retry_after="retry-after" in response.headers)
        except httpx.HTTPError as error:
            outcome = "failure"
            self.registry.report_failure(worker.id, f"prefill failed: {type(error).__name__}: {error}")
            return None
        finally:
            self.registry.end(worker.id, outcome)
            self._prefill_tokens[worker.id] -= work
            if self._prefill_tokens[worker.id] <= 0:
                del self._prefill_tokens[worker.id]
        try:
            params = response.json() if response.status_code == httpx.codes.OK else None
        except ValueError:
            params = None
        if not isinstance(params, dict):
            log.warning("prefill refused", extra={"worker": worker.id, "status": response.status_code})
            return None
        return params
