"""The request path: find the model, build the routing context, choose a worker, proxy, retry.

A request is retried on another worker (up to ``max_attempts`` distinct workers) when the chosen one
fails before its first byte: a transport error, or a 429/502/503/504 answer. A transport error also
ejects the worker at once. When every healthy worker is at its in-flight limit, or every attempt got
429, the client gets 429 with ``Retry-After``.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.responses import Response

from herd.api.kv_hash import block_hashes
from herd.api.protocol import REQUEST_ID_HEADER, WORKER_HEADER, is_valid_request_id
from herd.orchestrator.disagg import Handoff, TwoPhase
from herd.orchestrator.model_metrics import ModelMetrics
from herd.orchestrator.proxy import RelayResponse
from herd.orchestrator.registry import Registry
from herd.orchestrator.routing import RequestContext, WorkerView, healthy
from herd.orchestrator.served import RendererUnavailableError, ServedModel
from herd.orchestrator.state import State
from herd.orchestrator.telemetry import Telemetry
from herd.orchestrator.tokens import prompt_token_ids
from herd.orchestrator.upstream import Upstream, UpstreamClient, UpstreamError

__all__ = ["Gateway", "GatewayError", "GatewaySettings"]

log = logging.getLogger(__name__)

_RETRY_STATUSES = frozenset({429, 502, 503, 504})


class GatewayError(Exception):
    """An error answered to the client in the OpenAI envelope."""

    def __init__(self, status: int, message: str, *, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    request_timeout: float = 600.0
    """Longest wait for a worker's next byte (the first one included)."""
    connect_timeout: float = 2.0
    max_attempts: int = 3
    retry_after_seconds: int = 1


@dataclass(eq=False)
class _Request:
    served: ServedModel
    metrics: ModelMetrics
    path: str
    body: bytes
    is_stream: bool
    ctx: RequestContext
    started: float = field(default_factory=time.perf_counter)
    preferred_worker_id: str | None = None
    """Tried first when open (the decode worker a disaggregated plan paired with its prefill)."""
    prefill_seconds: float | None = None
    handoff: Handoff | None = None

    @property
    def request_id(self) -> str | None:
        """The client's ``X-Request-Id``, passed on when the worker would use it as given."""
        value = self.ctx.headers.get(REQUEST_ID_HEADER)
        return value if value is not None and is_valid_request_id(value) else None


class Gateway:
    def __init__(
        self,
        registry: Registry,
        state: State,
        http: httpx.AsyncClient,
        upstream: UpstreamClient,
        telemetry: Telemetry,
        settings: GatewaySettings | None = None,
    ) -> None:
        self.registry = registry
        self.state = state
        self.upstream = upstream
        """The hot path's client; ``http`` serves the prefill phase of disaggregated models."""
        self.telemetry = telemetry
        self.settings = settings or GatewaySettings()
        self._metrics: dict[str, ModelMetrics] = {}
        self.disagg = TwoPhase(registry, http, telemetry.registry, max_attempts=self.settings.max_attempts)
        self._untokenized: weakref.WeakSet[ServedModel] = weakref.WeakSet()
        """Models already logged as routed without tokens (once each)."""

    async def forward(
        self, path: str, body: bytes, payload: dict[str, Any], headers: Mapping[str, str]
    ) -> Response:
        """Route and proxy one OpenAI request whose JSON ``payload`` was parsed from ``body``."""
        served = self._served(payload)
        ctx = await self._context(served, payload, headers)
        request = _Request(served, self._metrics_of(served), path, body, payload.get("stream") is True, ctx)
        request.metrics.in_flight.inc()
        try:
            if served.config.mode == "disaggregated":
                await self._hand_off(request, payload)
            return await self._attempt(request)
        except GatewayError as error:
            self._finish(request, None, error.status, None)
            if request.handoff is not None:
                await self.disagg.release(request.handoff)
            raise

    def _metrics_of(self, served: ServedModel) -> ModelMetrics:
        metrics = self._metrics.get(served.name)
        if metrics is None:
            metrics = self._metrics[served.name] = ModelMetrics(self.telemetry, served.name)
        return metrics

    async def _hand_off(self, request: _Request, payload: dict[str, Any]) -> None:
        """Run the prefill phase of a disaggregated model; the decode phase is the usual attempt."""
        handoff = await self.disagg.plan(request.served, request.ctx, payload, request.body)
        request.body, request.preferred_worker_id = handoff.body, handoff.decode_worker_id
        request.handoff = handoff
        if handoff.path == "remote_prefill":
            request.prefill_seconds = handoff.prefill_seconds

    def _served(self, payload: dict[str, Any]) -> ServedModel:
        model = payload.get("model")
        if not isinstance(model, str):
            raise GatewayError(400, "the request needs a string `model` field naming a served model")
        served = self.registry.models.get(model)
        if served is None:
            known = ", ".join(sorted(self.registry.models)) or "none"
            raise GatewayError(
                404, f"model {model!r} is not served here (served: {known}); see GET /v1/models"
            )
        return served

    async def _context(
        self, served: ServedModel, payload: dict[str, Any], headers: Mapping[str, str]
    ) -> RequestContext:
        token_ids = self._prompt_tokens(served, payload) if served.strategy.needs_tokens else ()
        hashes = _hashes(served, token_ids, payload.get("cache_salt")) if token_ids else ()
        session_key = headers.get(served.session_header)
        pinned = None
        if served.strategy.pins_sessions and session_key:
            pinned = await self.state.get_pin(_pin_key(served, session_key))
        return RequestContext(
            model=served.name,
            token_ids=token_ids,
            block_hashes=hashes,
            session_key=session_key,
            pinned_worker_id=pinned,
            headers=headers,  # the server's read-only mapping: no copy per request
        )

    def _prompt_tokens(self, served: ServedModel, payload: dict[str, Any]) -> tuple[int, ...]:
        """The prompt's token ids; none (the strategy's load-only fallback) while no tokenizer is known."""
        try:
            return tuple(prompt_token_ids(served.renderer, payload))
        except RendererUnavailableError as error:
            if served not in self._untokenized:
                self._untokenized.add(served)
                log.warning(
                    "routing without tokens (least in-flight) until the tokenizer is fetched",
                    extra={"model": served.name, "reason": str(error)},
                )
            return ()
        except ValueError as error:
            raise GatewayError(400, f"invalid request: {error}") from None

    async def _attempt(self, request: _Request) -> Response:
        tried: set[str] = set()
        last_error = GatewayError(503, "no worker could serve the request; retry shortly")
        for _ in range(self.settings.max_attempts):
            worker = await self._choose(request, tried)
            tried.add(worker.id)
            self.registry.begin(worker.id)
            try:
                return await self._respond(request, worker)
            except GatewayError as error:
                self.registry.end(worker.id)
                request.metrics.retries.inc()
                last_error = error
            if not self._candidates(request, tried):
                break
        raise last_error

    def _candidates(self, request: _Request, tried: set[str]) -> list[WorkerView]:
        views = healthy(self.registry.views(request.served.name))
        return [view for view in views if view.id not in tried]

    async def _choose(self, request: _Request, tried: set[str]) -> WorkerView:
        served = request.served
        candidates = self._candidates(request, tried)
        if not candidates:
            raise GatewayError(503, f"model {served.name!r} has no healthy worker right now; retry shortly")
        limit = served.config.max_in_flight_per_worker
        open_workers = [view for view in candidates if not limit or view.num_in_flight < limit]
        if not open_workers:
            raise self._busy(served)
        if preferred := next((view for view in open_workers if view.id == request.preferred_worker_id), None):
            return preferred
        started = time.perf_counter()
        choice = served.strategy.select(open_workers, request.ctx)
        request.metrics.decision.observe(time.perf_counter() - started)
        if choice is None:
            raise self._busy(served)
        if request.ctx.block_hashes:
            num_hits = served.kv_index.match(request.ctx.block_hashes).get(choice.id, 0)
            request.metrics.cache_hit_blocks.observe(num_hits)
            served.kv_index.expect(choice.id, request.ctx.block_hashes)
        return await self._pin(request, choice, open_workers)

    async def _pin(self, request: _Request, choice: WorkerView, workers: list[WorkerView]) -> WorkerView:
        """Record the session's worker; a replica that pinned the session first wins the race."""
        ctx, served = request.ctx, request.served
        if not (served.strategy.pins_sessions and ctx.session_key):
            return choice
        key, ttl = (
            _pin_key(served, ctx.session_key),
            getattr(served.config.routing, "session_ttl_seconds", 3600),
        )
        if ctx.pinned_worker_id is None:
            winner = await self.state.claim_pin(key, choice.id, ttl)
            return next((view for view in workers if view.id == winner), choice)
        await self.state.set_pin(key, choice.id, ttl)
        return choice

    def _busy(self, served: ServedModel) -> GatewayError:
        retry_after = str(self.settings.retry_after_seconds)
        message = f"every worker of model {served.name!r} is at capacity; retry after {retry_after}s"
        return GatewayError(429, message, headers={"Retry-After": retry_after})

    async def _respond(self, request: _Request, worker: WorkerView) -> Response:
        upstream = await self._open(request, worker)
        headers = {WORKER_HEADER: worker.id}
        if request.is_stream and upstream.status_code == httpx.codes.OK:
            ttft = time.perf_counter() - request.started
            request.metrics.ttft.observe(ttft)
            if request.prefill_seconds is not None:
                self.disagg.observe_decode(request.served, ttft - request.prefill_seconds)
            return RelayResponse(
                upstream,
                headers=headers,
                on_done=lambda is_clean: self._finish(request, worker.id, 200 if is_clean else 502, ttft),
            )
        try:
            content = await upstream.read_rest()
        except UpstreamError as error:
            raise self._worker_failed(worker, error) from None
        self._finish(request, worker.id, upstream.status_code, None)
        return Response(content, upstream.status_code, headers={**upstream.headers_for_client(), **headers})

    async def _open(self, request: _Request, worker: WorkerView) -> Upstream:
        try:
            upstream = await self.upstream.post(
                worker.url + request.path, request.body, request_id=request.request_id
            )
        except UpstreamError as error:
            raise self._worker_failed(worker, error) from None
        if upstream.status_code in _RETRY_STATUSES:
            await upstream.aclose()
            if upstream.status_code == httpx.codes.TOO_MANY_REQUESTS:
                raise self._busy(request.served)
            raise GatewayError(503, f"worker {worker.id} answered {upstream.status_code}; retry shortly")
        return upstream

    def _worker_failed(self, worker: WorkerView, error: UpstreamError) -> GatewayError:
        reason = str(error)
        self.registry.report_failure(worker.id, reason)
        return GatewayError(502, f"worker {worker.id} failed before answering ({reason}); retry the request")

    def _finish(self, request: _Request, worker_id: str | None, status: int, ttft: float | None) -> None:
        metrics = request.metrics
        if worker_id is not None:
            self.registry.end(worker_id)
        metrics.count_finished(worker_id or "", status)
        metrics.e2e.observe(time.perf_counter() - request.started)
        metrics.in_flight.dec()
        self.telemetry.recent.record(ttft)


def _hashes(served: ServedModel, token_ids: tuple[int, ...], cache_salt: Any) -> tuple[int, ...]:
    config = served.config
    return tuple(block_hashes(token_ids, config.block_size, model_id=served.name, cache_salt=cache_salt))


def _pin_key(served: ServedModel, session_key: str) -> str:
    return f"{served.name}:{session_key}"
