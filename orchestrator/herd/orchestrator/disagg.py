"""Disaggregated serving: run the prefill phase that a routing decision paired with its decode worker.

``decide`` (``herd.orchestrator.routing.decision``) chooses the decode worker and, when the prompt's
uncached part should be computed on the prefill pool (``pairing.choose_path``), the prefill worker;
the gateway counts both at once. Then ``TwoPhase``:

1. sends the request to the prefill worker's ``POST /internal/prefill`` with ``kv_transfer_params``
   asking for a remote decode and carrying the prompt's token ids and block hashes as the gateway
   rendered them, so the prefill worker renders nothing and hashes nothing again;
2. on a failure, reports the worker and asks ``decide_prefill`` for the next one (counted at once
   too); when none succeeds, the decode worker prefills locally;
3. builds the decode phase's body: the request with the prefill worker's ``kv_transfer_params`` plus
   the prompt ids (the ids alone on the local path), which the decode worker validates once, pulls
   the blocks it lacks with, and runs without rendering the prompt.

A model whose tokenizer the gateway does not know yet sends no ids: then each worker renders.
Per-phase timings go to ``herd_router_phase_seconds`` and to one log line per request.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Histogram

from herd.api import metrics as names
from herd.api.protocol import INTERNAL_PATHS
from herd.orchestrator.breaker import Outcome, answer_outcome
from herd.orchestrator.registry import Hold, Registry
from herd.orchestrator.routing import RequestContext, decide_prefill
from herd.orchestrator.served import ServedModel

__all__ = ["Handoff", "TwoPhase"]

log = logging.getLogger(__name__)

_PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class Handoff:
    """What the decode phase sends after a remote prefill: the body with ``kv_transfer_params``."""

    body: bytes
    prefill_seconds: float
    params: Mapping[str, Any]
    """The prefill worker's ``kv_transfer_params`` (its lease, released if no decode worker takes it)."""


def handed_body(payload: Mapping[str, Any], ctx: RequestContext, params: Mapping[str, Any]) -> bytes:
    """The request for the decode worker: ``params`` plus the prompt ids when the gateway has them."""
    handed = {**params, "prompt_token_ids": ctx.token_ids} if ctx.token_ids else dict(params)
    return json.dumps({**payload, "kv_transfer_params": handed}).encode()


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
        self.phase_seconds = Histogram(
            names.HERD_ROUTER_PHASE_SECONDS,
            "Time per phase of disaggregated requests (prefill; decode up to its first byte).",
            ["model", "phase"],
            buckets=_PHASE_BUCKETS,
            registry=metrics,
        )

    async def prefill(
        self, served: ServedModel, ctx: RequestContext, payload: Mapping[str, Any], first: Hold
    ) -> Handoff | None:
        """Prefill on ``first``'s worker (already counted), the next on failure; ``None`` if none did."""
        started = time.perf_counter()
        params = await self._prefill(served, ctx, payload, first)
        if params is None:
            return None
        seconds = time.perf_counter() - started
        self.phase_seconds.labels(served.name, "prefill").observe(seconds)
        log.info(
            "prefilled remotely",
            extra={
                "model": served.name,
                "num_blocks": len(params.get("remote_block_hashes") or ()),
                "prefill_seconds": round(seconds, 6),
            },
        )
        return Handoff(handed_body(payload, ctx, params), seconds, params)

    async def release(self, handoff: Handoff) -> None:
        """End the lease of a handoff no decode worker took (best effort: leases also expire)."""
        params = handoff.params
        if not params.get("remote_host") or not params.get("remote_port"):
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

    async def _prefill(
        self, served: ServedModel, ctx: RequestContext, payload: Mapping[str, Any], first: Hold
    ) -> dict[str, Any] | None:
        hold: Hold | None = first
        tried, num_attempts = {first.worker_id}, 0
        body = _prefill_body(payload, ctx)
        while hold is not None:
            params = await self._prefill_on(hold, body)
            if params is not None:
                return params
            num_attempts += 1
            hold = self._next_prefill(served, ctx, tried) if num_attempts < self.max_attempts else None
        log.warning(
            "no prefill worker succeeded; the decode worker prefills locally", extra={"model": served.name}
        )
        return None

    def _next_prefill(self, served: ServedModel, ctx: RequestContext, tried: set[str]) -> Hold | None:
        """The replacement for a failed prefill worker, counted as it is chosen."""
        excluded = dataclasses.replace(ctx, excluded=frozenset(tried))
        worker, num_tokens = decide_prefill(served, self.registry.all_views(served.name), excluded)
        if worker is None:
            return None
        tried.add(worker.id)
        return self.registry.hold(worker.id, num_prefill_tokens=num_tokens)

    async def _prefill_on(self, hold: Hold, body: bytes) -> dict[str, Any] | None:
        """The worker's ``kv_transfer_params``, or ``None`` (reported) when it failed; releases ``hold``."""
        endpoint = self.registry.workers[hold.worker_id].endpoint
        with hold:
            try:
                response = await self.http.post(
                    endpoint.internal_url + INTERNAL_PATHS.prefill,
                    content=body,
                    headers={**self.registry.client.headers, "content-type": "application/json"},
                    timeout=self.timeout,
                )
            except httpx.HTTPError as error:
                hold.release("failure")
                self.registry.report_failure(
                    hold.worker_id, f"prefill failed: {type(error).__name__}: {error}"
                )
                return None
            outcome: Outcome = answer_outcome(
                response.status_code, has_retry_after="retry-after" in response.headers
            )
            hold.release(outcome)
        try:
            params = response.json() if response.status_code == httpx.codes.OK else None
        except ValueError:
            params = None
        if not isinstance(params, dict):
            log.warning("prefill refused", extra={"worker": hold.worker_id, "status": response.status_code})
            return None
        return params


def _prefill_body(payload: Mapping[str, Any], ctx: RequestContext) -> bytes:
    """The prefill worker's request: a remote decode asked for, with the prompt as the gateway rendered it."""
    params: dict[str, Any] = {"do_remote_decode": True}
    if ctx.token_ids:
        params |= {"prompt_token_ids": ctx.token_ids, "prompt_block_hashes": ctx.block_hashes}
    return json.dumps({**payload, "kv_transfer_params": params}).encode()
