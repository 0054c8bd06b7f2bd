"""The request path: validate, tokenize, choose a worker, proxy, and retry only what no worker took.

1. The body is parsed with its route's OpenAI wire model (``herd.orchestrator.validation``). A model
   that routes by tokens, or serves disaggregated, has its prompt rendered, tokenized, length-checked
   against maxModelLen and hashed, once: a disaggregated request carries those ids and hashes to its
   prefill and decode workers (``herd.orchestrator.disagg``). A body of ``inline_prepare_bytes`` or
   more is parsed and tokenized on a small thread pool, so a multi-MB prompt never stalls the event
   loop (tokenization releases the GIL); a smaller one costs less inline than the hop to a thread,
   whose lowered priority makes it wait behind every busy process on a contended host.
2. The session's pin is read, then ``decide`` (``herd.orchestrator.routing.decision``) makes the
   whole choice and ``_route`` applies it in the same synchronous step: every chosen worker (decode
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

When every healthy worker is at its in-flight limit, or every attempt got 429, the client gets 429
with ``Retry-After``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.responses import Response

from herd.api.errors import HttpError, enveloped
from herd.api.kv_hash import block_hashes
from herd.api.openai import LengthError
from herd.api.prompt import PromptError, PromptThreads
from herd.api.protocol import REQUEST_ID_HEADER, WORKER_HEADER, is_valid_request_id
from herd.orchestrator.breaker import Outcome, answer_outcome
from herd.orchestrator.disagg import Handoff, TwoPhase, handed_body
from herd.orchestrator.model_metrics import ModelMetrics
from herd.orchestrator.proxy import RelayResponse, StreamEnd
from herd.orchestrator.registry import Hold, Registry
from herd.orchestrator.routing import Decision, RequestContext, UnroutableError, WorkerView, decide, pin_key
from herd.orchestrator.served import RendererUnavailableError, ServedModel
from herd.orchestrator.state import State
from herd.orchestrator.telemetry import Telemetry
from herd.orchestrator.tokens import prompt_token_ids
from herd.orchestrator.upstream import (
    NotAnsweredError,
    Upstream,
    UpstreamClient,
    UpstreamError,
    UpstreamTimeoutError,
)
from herd.orchestrator.validation import ParsedRequest, check_length, parse_request

__all__ = ["Gateway", "GatewaySettings"]

log = logging.getLogger(__name__)


GATEWAY_INLINE_BYTES = 4096
"""Bodies below this size are prepared inline: a chat prompt of up to ~1k tokens takes a few ms to
parse, render, tokenize and hash, while the prompt threads' hop (niced 10 below the loop) waited 80 ms
at p50 and up to 13 s with the host's cores busy (issue 14; docs/routing.md)."""

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
    inline_prepare_bytes: int = GATEWAY_INLINE_BYTES
    """Bodies from this size on are parsed and tokenized on ``prepare_threads`` (``PromptThreads``)."""
    prepare_threads: int = 2


@dataclass(eq=False)
class _Request:
    served: ServedModel
    metrics: ModelMetrics
    path: str
    body: bytes
    is_stream: bool
    ctx: RequestContext
    payload: dict[str, Any]
    started: float = field(default_factory=time.perf_counter)
    prefill_seconds: float | None = None
    handoff: Handoff | None = None

    @property
    def request_id(self) -> str | None:
        """The client's ``X-Request-Id``, passed on when the worker would use it as given."""
        value = self.ctx.headers.get(REQUEST_ID_HEADER)
        return value if value is not None and is_valid_request_id(value) else None


@dataclass(eq=False)
class _Route:
    """A decision applied: its workers counted in flight until their holds are released."""

    decision: Decision
    hold: Hold
    prefill_hold: Hold | None

    @property
    def worker(self) -> WorkerView:
        return self.decision.worker

    def release(self, outcome: Outcome) -> None:
        self.hold.release(outcome)
        if self.prefill_hold is not None:
            self.prefill_hold.release(outcome)


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
        self.disagg = TwoPhase(registry, http, telemetry.registry, max_attempts=self.settings.max_attempts)
        self._untokenized: weakref.WeakSet[ServedModel] = weakref.WeakSet()
        """Models already logged as routed without tokens (once each)."""
        self._prepare_threads = PromptThreads(
            "herd-prepare", self.settings.prepare_threads, inline_bytes=self.settings.inline_prepare_bytes
        )

    def close(self) -> None:
        self._prepare_threads.close()

    async def forward(self, path: str, body: bytes, headers: Mapping[str, str]) -> Response:
        """Validate, route and proxy one OpenAI request; ``path`` is its route (``WIRE_MODELS``)."""
        parsed = await self._prepare_threads.run_sized(len(body), parse_request, path, body)
        served, lora_name = self._served(parsed.request.model)
        ctx = await self._context(served, parsed, headers, len(body), lora_name)
        metrics = self._metrics_of(served)
        request = _Request(served, metrics, path, body, parsed.request.stream, ctx, parsed.payload)
        request.metrics.in_flight.inc()
        try:
            return await self._attempt(request)
        except BaseException as error:
            self._count(request, "", error.status if isinstance(error, HttpError) else 500, None)
            if request.handoff is not None:
                await self.disagg.release(request.handoff)
            raise

    def _metrics_of(self, served: ServedModel) -> ModelMetrics:
        metrics = self._metrics.get(served.name)
        if metrics is None:
            metrics = self._metrics[served.name] = ModelMetrics(self.telemetry, served.name)
        return metrics

    def _served(self, model: str) -> tuple[ServedModel, str | None]:
        """The served model ``model`` names and its LoRA adapter, if it names one; 404 otherwise."""
        resolved = self.registry.resolve(model)
        if resolved is None:
            known = ", ".join(sorted(self.registry.models)) or "none"
            raise HttpError(
                404,
                f"model {model!r} is not served here, neither a model nor a LoRA adapter (served: {known}); "
                "see GET /v1/models",
                param="model",
            )
        return resolved

    async def _context(
        self,
        served: ServedModel,
        parsed: ParsedRequest,
        headers: Mapping[str, str],
        size: int,
        lora_name: str | None,
    ) -> RequestContext:
        token_ids, hashes = (
            await self._tokens(served, parsed, size, lora_name) if served.needs_tokens else ((), ())
        )
        session_key = headers.get(served.session_header)
        pinned = None
        if served.strategy.pins_sessions and session_key:
            pinned = await self.state.get_pin(pin_key(served.name, session_key))
        return RequestContext(
            model=served.name,
            token_ids=token_ids,
            block_hashes=hashes,
            session_key=session_key,
            pinned_worker_id=pinned,
            headers=headers,  # the server's read-only mapping: no copy per request
            lora_name=lora_name,
        )

    async def _tokens(
        self, served: ServedModel, parsed: ParsedRequest, size: int, lora_name: str | None
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The prompt's token ids and block hashes (with the adapter, as the worker hashes them);
        none (the strategy's load-only fallback) while no tokenizer is known."""
        threads = self._prepare_threads
        try:
            if not served.has_renderer:  # the first prompt loads the tokenizer (~0.7 s): never on the loop
                return await threads.run(_tokenize, served, parsed, lora_name)
            return await threads.run_sized(size, _tokenize, served, parsed, lora_name)
        except RendererUnavailableError as error:
            if served not in self._untokenized:
                self._untokenized.add(served)
                log.warning(
                    "routing without tokens (least in-flight) until the tokenizer is fetched",
                    extra={"model": served.name, "reason": str(error)},
                )
            return (), ()
        except LengthError as error:
            raise HttpError(400, str(error), param=error.param) from None
        except PromptError as error:
            raise HttpError(400, str(error), param=parsed.prompt_param) from None

    async def _attempt(self, request: _Request) -> Response:
        tried: set[str] = set()
        error: HttpError | None = None
        for _ in range(self.settings.max_attempts):
            try:
                route = await self._routed(request, tried)
            except UnroutableError as refusal:
                if error is not None and refusal.reason == "no_healthy_worker":
                    raise error from None  # every worker was tried: the last one's answer stands
                raise self._refused(request.served, refusal) from None
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

    async def _routed(self, request: _Request, tried: set[str]) -> _Route:
        """The request's route, counted (``_route``), then its session pin written."""
        route = self._route(request, tried)
        try:
            return await self._pin(request, route, tried)
        except BaseException:
            route.release("none")
            raise

    def _route(self, request: _Request, tried: set[str]) -> _Route:
        """Decide and apply the decision in one synchronous step: nothing awaits between the choice
        and the in-flight counts, so the next request's decision sees them."""
        served, ctx = request.served, request.ctx
        if tried:
            ctx = dataclasses.replace(ctx, excluded=frozenset(tried))
        started = time.perf_counter()
        decision = decide(served, self.registry.all_views(served.name), ctx)
        request.metrics.decision.observe(time.perf_counter() - started)
        prefill = decision.prefill
        local_prefill_tokens = decision.num_prefill_tokens if prefill is None else 0
        hold = self.registry.hold(decision.worker.id, num_prefill_tokens=local_prefill_tokens)
        prefill_hold = (
            None
            if prefill is None
            else self.registry.hold(prefill.id, num_prefill_tokens=decision.num_prefill_tokens)
        )
        if decision.expected_blocks:
            request.metrics.cache_hit_blocks.observe(decision.num_cached_blocks)
            for worker in (decision.worker, prefill):
                if worker is not None:
                    served.kv_index.expect(worker.id, decision.expected_blocks)
                    self.state.share_expected(worker.id, decision.expected_blocks)
        return _Route(decision, hold, prefill_hold)

    async def _pin(self, request: _Request, route: _Route, tried: set[str]) -> _Route:
        """Write the session's pin; when another replica claimed the session first, route again to its
        worker (the claim's winner wins the race)."""
        pin = route.decision.pin
        if pin is None:
            return route
        if not pin.is_claim:
            await self.state.set_pin(pin.key, pin.worker_id, pin.ttl_seconds)
            return route
        winner = await self.state.claim_pin(pin.key, pin.worker_id, pin.ttl_seconds)
        if winner == pin.worker_id:
            return route
        route.release("none")
        request.ctx = dataclasses.replace(request.ctx, pinned_worker_id=winner)
        return self._route(request, tried)

    async def _serve(self, request: _Request, route: _Route) -> Response:
        """The prefill phase of a disaggregated request first (once), then the worker's answer."""
        await self._load_lora(request, route)
        if request.served.config.mode == "disaggregated" and not request.ctx.is_prefilled:
            await self._hand_off(request, route.prefill_hold)
            request.ctx = dataclasses.replace(request.ctx, is_prefilled=True)
        return await self._respond(request, route.worker, route.hold)

    async def _load_lora(self, request: _Request, route: _Route) -> None:
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
        return HttpError(
            503,
            f"model {served.name!r} has no healthy worker right now; retry shortly",
            headers={"Retry-After": str(self.settings.retry_after_seconds)},
        )

    def _busy(self, served: ServedModel) -> HttpError:
        retry_after = str(self.settings.retry_after_seconds)
        message = f"every worker of model {served.name!r} is at capacity; retry after {retry_after}s"
        return HttpError(429, message, headers={"Retry-After": retry_after})

    async def _respond(self, request: _Request, worker: WorkerView, hold: Hold) -> Response:
        """The worker's answer; it releases the worker's ``hold`` exactly when the answer ends."""
        upstream = await self._open(request, worker)
        headers = {WORKER_HEADER: worker.id}
        if request.is_stream and upstream.status_code == httpx.codes.OK:
            hold.prefilled()  # the first chunk is out: the worker's prefill is no longer queued work
            ttft = time.perf_counter() - request.started
            request.metrics.ttft.observe(ttft)
            if request.prefill_seconds is not None:
                self.disagg.observe_decode(request.served, ttft - request.prefill_seconds)
            return RelayResponse(
                upstream,
                headers=headers,
                on_done=lambda ending: self._stream_done(request, hold, ending, ttft),
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
        self._finish(request, hold, status, None, outcome)
        return Response(content, status, headers=headers)

    async def _open(self, request: _Request, worker: WorkerView) -> Upstream:
        """The worker's answer up to its first chunk; ``_NotServedError`` when another worker may take it."""
        try:
            upstream = await self.upstream.post(
                worker.url + request.path, request.body, request_id=request.request_id
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

    def _unavailable(
        self, served: ServedModel, worker: WorkerView, status: int, retry_after: str
    ) -> HttpError:
        """The error when the last worker tried was full (429) or draining (503)."""
        if status == httpx.codes.TOO_MANY_REQUESTS:
            return self._busy(served)
        message = f"worker {worker.id} is draining or not ready; retry after {retry_after}s"
        return HttpError(503, message, headers={"Retry-After": retry_after})

    def _stream_done(self, request: _Request, hold: Hold, ending: StreamEnd, ttft: float) -> None:
        status, outcome = _STREAM_ENDS[ending]
        self._finish(request, hold, status, ttft, outcome)

    def _finish(
        self, request: _Request, hold: Hold, status: int, ttft: float | None, outcome: Outcome
    ) -> None:
        hold.release(outcome)
        self._count(request, hold.worker_id, status, ttft)

    def _count(self, request: _Request, worker_id: str, status: int, ttft: float | None) -> None:
        metrics = request.metrics
        metrics.count_finished(worker_id, status)
        metrics.e2e.observe(time.perf_counter() - request.started)
        metrics.in_flight.dec()
        self.telemetry.recent.record(ttft)


def _tokenize(
    served: ServedModel, parsed: ParsedRequest, lora_name: str | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The prompt's token ids, checked against maxModelLen, and its block hashes (may run on a thread)."""
    config = served.config
    token_ids = tuple(prompt_token_ids(served.renderer, parsed.request, max_model_len=config.max_model_len))
    check_length(parsed, len(token_ids), config.max_model_len)
    hashes = block_hashes(
        token_ids,
        config.block_size,
        model_id=served.name,
        cache_salt=parsed.request.cache_salt,
        lora_name=lora_name,
    )
    return token_ids, tuple(hashes)


def _no_envelope(status: int, worker_id: str) -> Callable[[Any], str]:
    """The message for a worker's error answer that is not an OpenAI error envelope."""
    return lambda _: f"worker {worker_id} answered {status} without an OpenAI error body; retry the request"
