"""The request path: validate, tokenize, choose a worker, proxy, and retry only what no worker took.

1. ``Preparer`` (``herd.orchestrator.prepare``) parses the body with its route's OpenAI wire model,
   finds its model, and for a model that routes by tokens, or serves disaggregated, renders,
   tokenizes, length-checks and hashes its prompt once (large bodies on a small thread pool): a
   disaggregated request carries those ids and hashes to its prefill and decode workers
   (``herd.orchestrator.disagg``). It reads the session's pin.
2. ``decide`` (``herd.orchestrator.routing.decision``) makes the whole choice and ``apply_decision``
   (``herd.orchestrator.apply``) applies it in the same synchronous step: every chosen worker (decode
   and prefill) is counted in flight by a ``Hold`` before anything is awaited, and its blocks are
   expected in the KV index. The pin is written after (a replica that claimed the session first
   wins: the request is then routed again with that pin).
3. A request is retried on another worker (up to ``max_attempts`` distinct workers) only when it
   never reached an engine: its connection failed before any byte of an answer (``NotAnsweredError``:
   refused, reset, closed; the worker is also ejected at once), or the worker answered 429 or 503
   with ``Retry-After`` (full or draining). Anything else (a 500, a 4xx, a 502 or 504, a 503 without
   ``Retry-After``, a timeout, a failure after the first byte) goes back to the client in the OpenAI
   envelope: a request that broke one worker is never handed to the next.
4. Every attempt's outcome feeds the worker's circuit breaker (``Hold.release``), which stops routing
   to a worker whose requests keep failing.
5. A stream is asked of the worker as resumable (``herd.api.resume``): when the worker's connection
   breaks mid-stream, ``_StreamResume`` sends the request, with the output tokens the client already
   has, to another worker, and the client's stream goes on from that worker's answer (up to
   ``max_resumes`` times). A worker that sends a stream without resume marks (the vLLM sidecar's)
   keeps rule 3: its failure ends the stream with an error event.

When every healthy worker is at its in-flight limit, or every attempt got 429, the client gets 429
with ``Retry-After``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from opentelemetry.trace import Span, SpanKind, StatusCode, set_span_in_context, use_span
from starlette.responses import Response

from herd.api.errors import HttpError, enveloped
from herd.api.protocol import REQUEST_ID_HEADER, WORKER_HEADER, is_valid_request_id
from herd.api.resume import RESUMABLE_HEADER, RESUME_FIELD
from herd.api.tracing import client_trace_headers, context_from, trace_headers, tracer
from herd.orchestrator.access_log import AccessEntry, slo_note
from herd.orchestrator.admission.gate import Admission, Ticket, admitted_context, ticket_for
from herd.orchestrator.admission.quotas import Quotas
from herd.orchestrator.admission.tenants import (
    ANONYMOUS,
    LOWEST_PRIORITY,
    Tenant,
)
from herd.orchestrator.admission.usage import StreamTally, Usage, usage_of
from herd.orchestrator.admission.waiting import QueueSettings
from herd.orchestrator.apply import Route, apply_decision, decide_with_headroom, write_pin
from herd.orchestrator.breaker import Outcome, answer_outcome
from herd.orchestrator.cold_start import ColdStarts, ColdStartSettings
from herd.orchestrator.disagg import Handoff, TwoPhase, handed_body
from herd.orchestrator.model_metrics import ModelMetrics
from herd.orchestrator.prepare import INLINE_PREPARE_BYTES, Preparer
from herd.orchestrator.proxy import RelayResponse, StreamEnd
from herd.orchestrator.registry import Hold, Registry
from herd.orchestrator.resume import StreamLedger
from herd.orchestrator.routing import Decision, RequestContext, UnroutableError, WorkerView
from herd.orchestrator.routing._types import SloMiss
from herd.orchestrator.routing.headroom import Headrooms, IdleHeadroom
from herd.orchestrator.routing.latency import LatencyFeatures, Prediction
from herd.orchestrator.routing.reserve import SlotReserve
from herd.orchestrator.served import ServedModel
from herd.orchestrator.state import State
from herd.orchestrator.telemetry import Telemetry
from herd.orchestrator.upstream import (
    NotAnsweredError,
    Upstream,
    UpstreamClient,
    UpstreamError,
    UpstreamTimeoutError,
)
from herd.orchestrator.validation import ParsedRequest

__all__ = ["Gateway", "GatewaySettings"]

log = logging.getLogger(__name__)
_tracer = tracer(__name__)

_NOTHING_USED = Usage(0, 0)
_RESUMABLE = {RESUMABLE_HEADER: "1"}
_STREAM_ENDS: dict[StreamEnd, tuple[int, Outcome]] = {
    "complete": (200, "success"),
    "worker_failed": (502, "failure"),
    "client_left": (499, "none"),  # nginx's status for a client that closed the request
}


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    request_timeout: float = 600.0
    """Longest wait for a worker's next byte (the first one included)."""
    connect_timeout: float = 2.0
    max_attempts: int = 3
    retry_after_seconds: int = 1
    inline_prepare_bytes: int = INLINE_PREPARE_BYTES
    """Bodies from this size on are parsed and tokenized on ``prepare_threads`` (``PromptThreads``)."""
    prepare_threads: int = 2
    queue: QueueSettings = field(default_factory=QueueSettings)
    """Each model's queue of requests waiting for a worker (``herd.orchestrator.admission``)."""
    slo_miss: SloMiss = "route"
    """What happens to a request with latency targets no worker is predicted to meet, unless its
    ``x-slo-policy`` header says (``herd.orchestrator.routing.SloTarget``)."""
    slot_reserve: SlotReserve = field(default_factory=SlotReserve)
    """The part of each worker's slots that background requests (a batch's lines) leave to more urgent
    ones (``herd.orchestrator.routing.reserve``)."""
    idle_headroom: IdleHeadroom = field(default_factory=IdleHeadroom)
    """The workers background requests leave free of background work while interactive traffic is
    recent (``herd.orchestrator.routing.headroom``)."""
    access_log_prompts: bool = False
    """Put each request's messages or prompt in its access-log line (``herd.access``); off by default."""
    max_resumes: int = 2
    """Times one stream is taken over by another worker after its worker failed mid-answer; 0 ends
    such a stream with an error event. A bound, so a request that kills workers kills few."""
    cold_start: ColdStartSettings = field(default_factory=ColdStartSettings)
    """The line of requests for models that scaled to zero (``herd.orchestrator.cold_start``)."""


@dataclass(eq=False)
class _Request:
    served: ServedModel
    metrics: ModelMetrics
    path: str
    body: bytes
    is_stream: bool
    ctx: RequestContext
    payload: dict[str, Any]
    ticket: Ticket
    quota_headers: dict[str, str]
    """The tenant's ``x-ratelimit-*`` headers, for the answer."""
    span: Span
    """The request's span; every span of the gateway's work on it is a child of it."""
    trace_headers: dict[str, str]
    """The ``traceparent`` the client sent, passed on when this process records no span."""
    started: float = field(default_factory=time.perf_counter)
    prefill_seconds: float | None = None
    handoff: Handoff | None = None
    is_two_phase: bool = False
    """A disaggregated model's completion: prefilled on the prefill pool first (an embedding never is)."""
    upstream_span: Span | None = None
    """The worker's part: from sending it the request to the end of its answer."""
    worker_request_id: str | None = None
    """The id the worker gave the response (its ``X-Request-Id``) when the client sent none."""
    num_resumes: int = 0
    slo_note: dict[str, float] | None = None
    """What the SLO choice predicted against what followed, for the access log (``slo_note``)."""

    def end_upstream(self, status: int, error: BaseException | None = None) -> None:
        span, self.upstream_span = self.upstream_span, None
        if span is not None:
            _end(span, status, error)

    def child(self, name: str, attributes: Mapping[str, str | int]) -> Span:
        return _tracer.start_span(name, context=set_span_in_context(self.span), attributes=attributes)

    def worker_headers(self, span: Span) -> dict[str, str]:
        return trace_headers(span) or self.trace_headers

    @property
    def request_id(self) -> str | None:
        """The client's ``X-Request-Id``, passed on when the worker would use it as given."""
        value = self.ctx.headers.get(REQUEST_ID_HEADER)
        return value if value is not None and is_valid_request_id(value) else None


class _NotServedError(Exception):
    """The worker did not take the request (it never reached an engine): another worker may."""

    def __init__(self, error: HttpError, outcome: Outcome) -> None:
        super().__init__(error.message)
        self.error = error
        self.outcome = outcome


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
        self._headrooms = Headrooms(self.settings.idle_headroom, self.settings.slot_reserve)
        """Each model's recent interactive peak, for the workers kept free of batch work."""
        self.disagg = TwoPhase(registry, http, telemetry.registry, max_attempts=self.settings.max_attempts)
        self.preparer = Preparer(
            registry,
            state,
            inline_bytes=self.settings.inline_prepare_bytes,
            num_threads=self.settings.prepare_threads,
        )
        self.admission = Admission(self.settings.queue, retry_after_seconds=self.settings.retry_after_seconds)
        registry.on_room = self.admission.wake
        self.quotas = Quotas(state)
        self.cold_starts = ColdStarts(
            registry,
            self.settings.cold_start,
            on_held=lambda model, count: telemetry.held.labels(model).set(count),
        )
        registry.on_admitted = self.cold_starts.wake

    def close(self) -> None:
        self.preparer.close()

    async def forward(
        self, path: str, body: bytes, headers: Mapping[str, str], tenant: Tenant = ANONYMOUS
    ) -> Response:
        """Validate, admit, route and proxy one OpenAI request of ``tenant``; ``path`` is its route
        (``WIRE_MODELS``)."""
        started = time.perf_counter()
        span = _tracer.start_span(
            "herd.gateway.request",
            context=context_from(headers),
            kind=SpanKind.SERVER,
            attributes={"http.route": path},
        )
        try:
            request = await self._admit(path, body, headers, tenant, span)
        except BaseException as error:
            status = error.status if isinstance(error, HttpError) else 500
            AccessEntry(
                request_id=headers.get(REQUEST_ID_HEADER),
                tenant=tenant.name,
                model=None,
                route=path,
                status=status,
                seconds=time.perf_counter() - started,
            ).log()
            _end(span, status, error)
            raise
        request.metrics.in_flight.inc()
        try:
            return await self._attempt(request)
        except BaseException as error:
            self._count(request, "", error.status if isinstance(error, HttpError) else 500, None)
            if request.handoff is not None:
                await self.disagg.release(request.handoff)
            raise

    async def _admit(
        self, path: str, body: bytes, headers: Mapping[str, str], tenant: Tenant, span: Span
    ) -> _Request:
        """Parse and prepare the request, check its tenant's model and quota: what ``_attempt`` routes."""
        prepared = await self.preparer.prepare(path, body, headers)
        served, parsed, ctx = prepared.served, prepared.parsed, prepared.ctx
        span.set_attributes({"herd.model": served.name, "herd.tenant": tenant.name})
        tenant.check_model(served.name)
        ticket = ticket_for(tenant, parsed.request, headers, len(body), len(ctx.token_ids))
        use = await self.quotas.admit(tenant, time.time())
        body = _with_priority(parsed, body, ticket.priority)
        ctx = admitted_context(ctx, ticket, headers, self.settings.slo_miss)
        return _Request(
            served,
            self._metrics_of(served),
            path,
            body,
            parsed.request.stream,
            ctx,
            parsed.payload,
            ticket,
            {} if use is None else use.headers(),
            span,
            client_trace_headers(headers),
            is_two_phase=served.config.mode == "disaggregated" and parsed.generates,
        )

    def _metrics_of(self, served: ServedModel) -> ModelMetrics:
        metrics = self._metrics.get(served.name)
        if metrics is None:
            metrics = self._metrics[served.name] = ModelMetrics(self.telemetry, served.name)
        return metrics

    async def _attempt(self, request: _Request) -> Response:
        await self.cold_starts.wait(request.served)  # a model at zero workers: until one is ready
        tried: set[str] = set()
        error: HttpError | None = None
        for _ in range(self.settings.max_attempts):
            queued = request.child("herd.gateway.admission", {"herd.priority": request.ticket.priority})
            try:
                route = await self.admission.route(
                    request.served.name, request.ticket, lambda: self._routed(request, tried)
                )
            except UnroutableError as refusal:
                _end(queued, 429 if refusal.reason != "no_healthy_worker" else 503, refusal)
                if error is not None and refusal.reason == "no_healthy_worker":
                    raise error from None  # every worker was tried: the last one's answer stands
                raise self._refused(request.served, refusal) from None
            except BaseException as failure:
                _end(queued, failure.status if isinstance(failure, HttpError) else 500, failure)
                raise
            queued.set_attribute("herd.worker", route.worker.id)
            queued.end()
            tried.add(route.worker.id)
            try:
                return await self._serve(request, route)
            except _NotServedError as not_served:
                route.release(not_served.outcome)
                request.metrics.retries.inc()
                error = not_served.error
            except HttpError:
                route.release("failure")
                raise
            except BaseException:
                route.release("none")
                raise
        assert error is not None
        raise error

    async def _routed(self, request: _Request, tried: set[str]) -> Route:
        """The request's route, counted (``_route``), then its session pin written."""
        route = self._route(request, tried)
        try:
            return await self._pin(request, route, tried)
        except BaseException:
            route.release("none")
            raise

    def _route(self, request: _Request, tried: set[str]) -> Route:
        """Decide and apply the decision in one synchronous step: nothing awaits between the choice
        and the in-flight counts, so the next request's decision sees them."""
        served, ctx = request.served, request.ctx
        if tried:
            ctx = dataclasses.replace(ctx, excluded=frozenset(tried))
        started = time.perf_counter()
        with _tracer.start_as_current_span(
            "herd.gateway.route", context=set_span_in_context(request.span)
        ) as span:
            views = self.registry.all_views(served.name)
            decision = decide_with_headroom(
                self.registry, self._headrooms, served, views, ctx, self.settings.slot_reserve
            )
            span.set_attributes(_decision_attributes(served, decision))
        request.metrics.decision.observe(time.perf_counter() - started)
        if decision.expected_blocks:
            request.metrics.cache_hit_blocks.observe(decision.num_cached_blocks)
        if decision.is_slo_missed and ctx.slo is not None and ctx.slo.on_miss == "lower":
            request.payload["priority"] = LOWEST_PRIORITY
            request.body = json.dumps(request.payload).encode()
        return apply_decision(self.registry, self.state, served, decision, priority=ctx.priority)

    async def _pin(self, request: _Request, route: Route, tried: set[str]) -> Route:
        """Write the session's pin; when another replica claimed the session first, route again to its
        worker (the claim's winner wins the race)."""
        winner = await write_pin(self.state, route)
        if winner is None:
            return route
        route.release("none")
        request.ctx = dataclasses.replace(request.ctx, pinned_worker_id=winner)
        return self._route(request, tried)

    async def _serve(self, request: _Request, route: Route) -> Response:
        """The prefill phase of a disaggregated request first (once), then the worker's answer."""
        await self._load_lora(request, route)
        if request.is_two_phase and not request.ctx.is_prefilled:
            await self._hand_off(request, route.prefill_hold)
            request.ctx = dataclasses.replace(request.ctx, is_prefilled=True)
        body = self._with_pull(request, route.decision.pull_from)
        decision = route.decision
        return await self._respond(
            request, route.worker, route.hold, decision.features, body, decision.predicted
        )

    def _with_pull(self, request: _Request, peer: WorkerView | None) -> bytes:
        """The body for the chosen worker: with the peer to pull the prompt's cached blocks from
        (its internal address, which the worker dials with the internal token) when the decision
        names one, else the request's own (a retry on another worker never inherits a pull)."""
        state = None if peer is None else self.registry.workers.get(peer.id)
        if state is None:
            return request.body
        params = {"peer_url": state.endpoint.internal_url}
        return json.dumps({**request.payload, "kv_transfer_params": params}).encode()

    async def _load_lora(self, request: _Request, route: Route) -> None:
        """Load the request's adapter on the chosen workers that lack it, when the gateway loaded it
        at runtime and so knows its folder (a manifest's adapters are on every worker from its start)."""
        name = request.ctx.lora_name
        path = None if name is None else request.served.lora_paths.get(name)
        if name is None or path is None:
            return
        for view in (route.worker, route.decision.prefill):
            if view is not None and name not in view.lora_adapters:
                await self.registry.change_lora(view.id, "load", {"lora_name": name, "lora_path": path})

    async def _hand_off(self, request: _Request, prefill: Hold | None) -> None:
        """Prefill on the decision's prefill worker, or hand the prompt ids to the decode worker."""
        handoff = None
        if prefill is not None:
            with _tracer.start_as_current_span(
                "herd.gateway.prefill",
                context=set_span_in_context(request.span),
                attributes={"herd.worker": prefill.worker_id},
            ):
                handoff = await self.disagg.prefill(request.served, request.ctx, request.payload, prefill)
        if handoff is not None:
            request.body, request.prefill_seconds, request.handoff = (
                handoff.body,
                handoff.prefill_seconds,
                handoff,
            )
        elif request.ctx.token_ids:
            request.body = handed_body(request.payload, request.ctx, {})

    def _refused(self, served: ServedModel, refusal: UnroutableError) -> HttpError:
        if refusal.reason == "at_capacity":
            return self._busy(served)
        if refusal.reason == "slo_unmet":
            retry_after = str(self.settings.retry_after_seconds)
            message = f"no worker of model {served.name!r} is predicted to meet the request's latency targets"
            return HttpError(
                429, f"{message}; retry after {retry_after}s", headers={"Retry-After": retry_after}
            )
        return HttpError(
            503,
            f"model {served.name!r} has no healthy worker right now; retry shortly",
            headers={"Retry-After": str(self.settings.retry_after_seconds)},
        )

    def _busy(self, served: ServedModel) -> HttpError:
        retry_after = str(self.settings.retry_after_seconds)
        message = f"every worker of model {served.name!r} is at capacity; retry after {retry_after}s"
        return HttpError(429, message, headers={"Retry-After": retry_after})

    async def _respond(
        self,
        request: _Request,
        worker: WorkerView,
        hold: Hold,
        features: LatencyFeatures | None,
        body: bytes,
        predicted: Prediction | None = None,
    ) -> Response:
        """The worker's answer; it releases the worker's ``hold`` exactly when the answer ends. A
        stream's first-token time and pace, from the moment it was sent, fit the latency model (and,
        with the SLO choice's ``predicted`` latency, go in its access-log line)."""
        sent = time.perf_counter()
        upstream = await self._open(request, worker, body)
        request.worker_request_id = upstream.headers.get(REQUEST_ID_HEADER.lower())
        headers = {**request.quota_headers, WORKER_HEADER: worker.id}
        if request.is_stream and upstream.status_code == httpx.codes.OK:
            hold.prefilled()  # the first chunk is out: the worker's prefill is no longer queued work
            first = time.perf_counter()
            ttft = first - request.started
            if features is not None:
                request.served.latency.observe_ttft(worker.id, features, first - sent)
                if predicted is not None:
                    request.slo_note = slo_note(features, predicted.ttft_seconds, first - sent)
            request.metrics.ttft.observe(ttft)
            if request.prefill_seconds is not None:
                self.disagg.observe_decode(request.served, ttft - request.prefill_seconds)
            tally = StreamTally()
            resume = _StreamResume(self, request, hold, upstream)
            return RelayResponse(
                upstream,
                headers=headers,
                on_done=lambda ending: self._stream_done(
                    request,
                    resume.hold,
                    ending,
                    ttft,
                    tally.total(request.ticket.num_prompt_tokens),
                    (None if request.num_resumes else features, first),
                ),
                on_chunk=tally.observe,
                resumer=resume if resume.is_resumable else None,
            )
        try:
            content = await upstream.read_rest()
        except UpstreamError as error:
            raise HttpError(
                502, f"worker {worker.id} failed mid-answer ({error}); retry the request"
            ) from None
        status = upstream.status_code
        headers = {**upstream.headers_for_client(), **headers}
        if status >= 400:
            content, headers["content-type"] = (
                enveloped(content, status, _no_envelope(status, worker.id)),
                "application/json",
            )
        outcome = answer_outcome(status, has_retry_after="retry-after" in upstream.headers)
        usage = (usage_of(content) if status == httpx.codes.OK else None) or _NOTHING_USED
        self._finish(request, hold, status, None, outcome, usage)
        await self.quotas.spend(request.ticket.tenant, usage.total_tokens, time.time())
        return Response(content, status, headers=headers)

    async def _open(
        self, request: _Request, worker: WorkerView, body: bytes | None = None, request_id: str | None = None
    ) -> Upstream:
        """The worker's answer up to its first chunk (to ``body``, by default the request's own);
        ``_NotServedError`` when another worker may take it. Its span is the request's
        ``upstream_span`` from here on."""
        span = request.upstream_span = request.child("herd.gateway.upstream", {"herd.worker": worker.id})
        headers = request.worker_headers(span)
        if request.is_stream:
            headers.update(_RESUMABLE)
        try:
            return await self._post(
                request, worker, request.body if body is None else body, request_id, headers
            )
        except BaseException as error:
            request.end_upstream(error.error.status if isinstance(error, _NotServedError) else 502, error)
            raise

    async def _post(
        self,
        request: _Request,
        worker: WorkerView,
        body: bytes,
        request_id: str | None,
        headers: dict[str, str],
    ) -> Upstream:
        try:
            upstream = await self.upstream.post(
                worker.url + request.path, body, request_id=request_id or request.request_id, headers=headers
            )
        except NotAnsweredError as error:
            self.registry.report_failure(worker.id, str(error))  # a killed worker: eject it now
            failed = HttpError(502, f"worker {worker.id} took no request ({error}); retry the request")
            raise _NotServedError(failed, "failure") from None
        except UpstreamTimeoutError as error:
            raise HttpError(504, f"worker {worker.id} timed out ({error}); retry the request") from None
        except UpstreamError as error:
            raise HttpError(
                502, f"worker {worker.id} broke its answer ({error}); retry the request"
            ) from None
        retry_after = upstream.headers.get("retry-after")
        if upstream.status_code in (429, 503) and retry_after is not None:
            await upstream.aclose()
            raise _NotServedError(
                self._unavailable(request.served, worker, upstream.status_code, retry_after), "none"
            )
        return upstream

    async def reopen(
        self, request: _Request, body: bytes, request_id: str | None, tried: set[str]
    ) -> tuple[Hold, Upstream]:
        """A resumed stream's answer from a worker not in ``tried`` (``_StreamResume``): routed as the
        request was, its admission not charged again, its prefill (if any) done by that worker."""
        ticket = dataclasses.replace(request.ticket, num_prompt_tokens=0, num_expected_output=0)
        for _ in range(self.settings.max_attempts):
            route = await self.admission.route(
                request.served.name, ticket, lambda: self._routed(request, tried)
            )
            tried.add(route.worker.id)
            if route.prefill_hold is not None:
                route.prefill_hold.release("none")
            try:
                return route.hold, await self._open(request, route.worker, body, request_id)
            except _NotServedError as not_served:
                route.hold.release(not_served.outcome)
            except BaseException:
                route.hold.release("none")
                raise
        raise HttpError(503, "no worker took the resumed stream")

    def _unavailable(
        self, served: ServedModel, worker: WorkerView, status: int, retry_after: str
    ) -> HttpError:
        """The error when the last worker tried was full (429) or draining (503)."""
        if status == httpx.codes.TOO_MANY_REQUESTS:
            return self._busy(served)
        message = f"worker {worker.id} is draining or not ready; retry after {retry_after}s"
        return HttpError(503, message, headers={"Retry-After": retry_after})

    def _stream_done(
        self,
        request: _Request,
        hold: Hold,
        ending: StreamEnd,
        ttft: float,
        usage: Usage,
        paced: tuple[LatencyFeatures | None, float],
    ) -> None:
        features, first = paced
        if ending == "complete" and features is not None and usage.completion_tokens > 1:
            tpot = (time.perf_counter() - first) / (usage.completion_tokens - 1)
            request.served.latency.observe_tpot(hold.worker_id, features, tpot)
        status, outcome = _STREAM_ENDS[ending]
        self._finish(request, hold, status, ttft, outcome, usage)
        self.quotas.spend_soon(request.ticket.tenant, usage.total_tokens, time.time())

    def _finish(
        self,
        request: _Request,
        hold: Hold,
        status: int,
        ttft: float | None,
        outcome: Outcome,
        usage: Usage,
    ) -> None:
        hold.release(outcome)
        self.admission.finished(request.served.name, request.ticket, usage.completion_tokens)
        self._count(request, hold.worker_id, status, ttft, usage)

    def _count(
        self, request: _Request, worker_id: str, status: int, ttft: float | None, usage: Usage | None = None
    ) -> None:
        """The request ended with ``status``: its metrics, its spans and its access-log line."""
        metrics = request.metrics
        seconds = time.perf_counter() - request.started
        metrics.count_finished(worker_id, status)
        metrics.e2e.observe(seconds)
        metrics.in_flight.dec()
        self.telemetry.recent.record(ttft)
        request.end_upstream(status)
        if usage is not None:
            request.span.set_attributes(
                {"herd.prompt_tokens": usage.prompt_tokens, "herd.completion_tokens": usage.completion_tokens}
            )
        _end(request.span, status)
        entry = AccessEntry(
            request_id=request.request_id or request.worker_request_id,
            tenant=request.ticket.tenant.name,
            model=request.served.name,
            route=request.path,
            status=status,
            seconds=seconds,
            worker=worker_id or None,
            is_stream=request.is_stream,
            usage=usage,
            ttft=ttft,
            num_resumes=request.num_resumes,
            slo=request.slo_note,
            prompt=_prompt_of(request.payload) if self.settings.access_log_prompts else None,
        )
        entry.log()


class _StreamResume:
    """One stream's side of ``herd.api.resume`` in the gateway: the ``StreamLedger`` of what its
    client has and, when its worker fails mid-answer, the same request with those tokens sent to
    another worker (``Gateway.reopen``). ``hold`` is the worker serving the stream now."""

    def __init__(self, gateway: Gateway, request: _Request, hold: Hold, upstream: Upstream) -> None:
        self.gateway = gateway
        self.request = request
        self.hold = hold
        self.is_resumable = _is_resumable(upstream)
        self.request_id = upstream.headers.get(REQUEST_ID_HEADER.lower())
        """The worker's id for the response, so the next worker's chunks carry the same ``id``."""
        self.ledger = StreamLedger()
        self.tried = {hold.worker_id}

    async def resume(self, error: UpstreamError) -> Upstream | None:
        gateway, request = self.gateway, self.request
        failed = self.hold.worker_id
        gateway.registry.report_failure(failed, f"its stream broke mid-answer ({error})")
        self.hold.release("failure")
        request.end_upstream(502, error)
        if request.num_resumes >= gateway.settings.max_resumes:
            self._failed(failed, "the stream was resumed as often as allowed")
            return None
        request.num_resumes += 1
        span = request.child(
            "herd.gateway.resume",
            {"herd.failed_worker": failed, "herd.num_tokens_sent": self.ledger.num_tokens},
        )
        with use_span(span, end_on_exit=True):
            return await self._reopen(failed)

    async def _reopen(self, failed: str) -> Upstream | None:
        gateway, request = self.gateway, self.request
        try:
            self.hold, upstream = await gateway.reopen(request, self._body(), self.request_id, self.tried)
        except (HttpError, UnroutableError) as refusal:
            self._failed(failed, str(refusal))
            return None
        if upstream.status_code != httpx.codes.OK or not _is_resumable(upstream):
            await upstream.aclose()
            self.hold.release("failure")
            request.end_upstream(upstream.status_code)
            self._failed(failed, f"worker {self.hold.worker_id} answered {upstream.status_code}")
            return None
        gateway.telemetry.resumes.labels(request.served.name, "resumed").inc()
        log.info(
            "stream resumed on another worker",
            extra={
                "model": request.served.name,
                "failed_worker": failed,
                "worker": self.hold.worker_id,
                "num_tokens_sent": self.ledger.num_tokens,
            },
        )
        return upstream

    def _body(self) -> bytes:
        """The request as first sent, with the client's tokens (and, disaggregated, the prompt ids
        the gateway rendered: the new worker prefills them itself)."""
        request = self.request
        payload = {**request.payload, RESUME_FIELD: self.ledger.resume_params().model_dump()}
        if request.served.config.mode == "disaggregated" and request.ctx.token_ids:
            payload["kv_transfer_params"] = {"prompt_token_ids": request.ctx.token_ids}
        return json.dumps(payload).encode()

    def _failed(self, worker_id: str, reason: str) -> None:
        self.gateway.telemetry.resumes.labels(self.request.served.name, "failed").inc()
        log.warning("a broken stream was not resumed", extra={"failed_worker": worker_id, "reason": reason})


def _is_resumable(upstream: Upstream) -> bool:
    return upstream.headers.get(RESUMABLE_HEADER.lower()) == "1"


def _with_priority(parsed: ParsedRequest, body: bytes, priority: int) -> bytes:
    """The body the workers get: the client's own, unless its priority was lowered or capped."""
    if (parsed.request.priority or 0) == priority:
        return body
    parsed.payload["priority"] = priority
    return json.dumps(parsed.payload).encode()


def _no_envelope(status: int, worker_id: str) -> Callable[[Any], str]:
    """The message for a worker's error answer that is not an OpenAI error envelope."""
    return lambda _: f"worker {worker_id} answered {status} without an OpenAI error body; retry the request"


def _end(span: Span, status: int, error: BaseException | None = None) -> None:
    """End ``span`` with the HTTP ``status`` it came to (an error from 500 on, as OpenTelemetry's
    HTTP conventions have it for servers)."""
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(StatusCode.ERROR, None if error is None else f"{type(error).__name__}: {error}")
    span.end()


def _decision_attributes(served: ServedModel, decision: Decision) -> dict[str, str | int | bool]:
    attributes: dict[str, str | int | bool] = {
        "herd.worker": decision.worker.id,
        "herd.strategy": served.config.routing.strategy,
        "herd.cached_blocks": decision.num_cached_blocks,
        "herd.slo_missed": decision.is_slo_missed,
    }
    if decision.prefill is not None:
        attributes["herd.prefill_worker"] = decision.prefill.id
    return attributes


def _prompt_of(payload: Mapping[str, Any]) -> Any:
    return payload.get("messages", payload.get("prompt"))
