"""The endpoint picker's edge over the routing decision: prepare, decide, hold, as herd's gateway does.

``Picker.pick`` prepares a request exactly as the gateway does (``Preparer``: parse, tokenize, hash,
the session pin), leaves out the workers outside the data plane's subset hint, calls ``decide`` and
applies the decision in the same synchronous step (``apply_decision``: the worker counted in flight,
its blocks expected). The returned ``Route`` stays held until the response ends (``Route.release``).
A disaggregated model cannot be served through a gateway that forwards each request to one endpoint,
so the picker refuses it and names herd's own gateway.

Admission is the gateway's (docs/admission.md), as far as ext_proc lets it be: the API key in
``Authorization`` names the tenant (401 for an unknown one when a keys file is given), whose models
and per-minute quotas apply (403; 429 with ``x-ratelimit-*``, the headers also on every answer, the
tokens counted from the answer's usage in ``finished``); ``x-slo-*`` headers set latency targets for
``decide``. The tenant's priority (lowered by the body's ``priority`` or ``X-Herd-Priority``) orders
the model's fair queue and, in ``decide``, keeps requests at the lowest priority out of the slot
reserve (``herd.orchestrator.routing.reserve``) and off the workers kept idle for interactive traffic
(``herd.orchestrator.routing.headroom``). A request that finds every worker full (or, at the
lowest priority, every unreserved slot taken) waits in that queue, the gateway's own ``Admission``,
while Envoy holds it (Envoy's ``message_timeout`` must exceed ``queue.max_wait_seconds``). The picker
never rewrites the body, so the engines schedule by the body's own ``priority``, and the ``lower``
SLO policy routes as ``route`` does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from herd.api.errors import HttpError
from herd.orchestrator.admission.gate import Admission, Ticket, admitted_context, ticket_for
from herd.orchestrator.admission.quotas import Quotas
from herd.orchestrator.admission.tenants import ANONYMOUS, Tenant
from herd.orchestrator.admission.usage import Usage
from herd.orchestrator.admission.waiting import QueueSettings
from herd.orchestrator.apply import Route, apply_decision, decide_with_headroom, write_pin
from herd.orchestrator.auth import ApiKeys
from herd.orchestrator.cold_start import ColdStarts
from herd.orchestrator.epp.wire import address_of
from herd.orchestrator.prepare import Prepared, Preparer
from herd.orchestrator.registry import Registry
from herd.orchestrator.routing import UnroutableError
from herd.orchestrator.routing._types import SloMiss
from herd.orchestrator.routing.headroom import Headrooms, IdleHeadroom
from herd.orchestrator.routing.reserve import SlotReserve
from herd.orchestrator.state import State

__all__ = ["Picked", "Picker", "PickerSettings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PickerSettings:
    retry_after_seconds: int = 1
    """``Retry-After`` on a 429 (every worker full) or a 503 (no worker ready)."""
    max_body_bytes: int = 4 * 1024 * 1024
    queue: QueueSettings = field(default_factory=QueueSettings)
    """Each model's queue while every worker is full; its wait stays under Envoy's ``message_timeout``."""
    slot_reserve: SlotReserve = field(default_factory=SlotReserve)
    """The part of each worker's slots that requests at the lowest priority leave to more urgent ones."""
    idle_headroom: IdleHeadroom = field(default_factory=IdleHeadroom)
    """The workers that requests at the lowest priority leave free of their work while interactive
    traffic is recent, or always (``herd.orchestrator.routing.headroom``)."""
    slo_miss: SloMiss = "route"
    """What a request with latency targets no worker is predicted to meet gets, unless ``x-slo-policy``
    says; ``lower`` routes as ``route`` (the picker does not rewrite the body's priority)."""


@dataclass(eq=False)
class Picked:
    """A request's route and the endpoint it names to the data plane."""

    route: Route
    address: str
    model: str
    ticket: Ticket
    quota_headers: dict[str, str] = field(default_factory=dict)
    """The tenant's ``x-ratelimit-*`` headers, for the answer."""


class Picker:
    def __init__(
        self,
        registry: Registry,
        state: State,
        preparer: Preparer,
        settings: PickerSettings | None = None,
        api_keys: ApiKeys | None = None,
    ) -> None:
        self.registry = registry
        self.state = state
        self.preparer = preparer
        self.settings = settings or PickerSettings()
        self.api_keys = api_keys or ApiKeys([])
        self.quotas = Quotas(state)
        self.admission = Admission(self.settings.queue, retry_after_seconds=self.settings.retry_after_seconds)
        self.headrooms = Headrooms(self.settings.idle_headroom, self.settings.slot_reserve)
        registry.on_room = self.admission.wake
        self.cold_starts = ColdStarts(registry)
        registry.on_admitted = self.cold_starts.wake

    async def pick(
        self, path: str, body: bytes, headers: Mapping[str, str], subset: frozenset[str] | None
    ) -> Picked:
        """The endpoint for one request, held; ``HttpError`` (400, 401, 403, 404, 429, 503, ...) when none."""
        tenant = self._tenant(headers)
        prepared = await self.preparer.prepare(path, body, headers)
        served = prepared.served
        if served.config.mode == "disaggregated":
            raise HttpError(
                501,
                f"model {served.name!r} serves disaggregated (prefill and decode pools), which a gateway "
                "that sends each request to one endpoint cannot run; send it through herd's gateway",
                param="model",
            )
        tenant.check_model(served.name)
        ticket = ticket_for(tenant, prepared.parsed.request, headers, len(body), len(prepared.ctx.token_ids))
        use = await self.quotas.admit(tenant, time.time())
        ctx = admitted_context(prepared.ctx, ticket, headers, self.settings.slo_miss)
        prepared = dataclasses.replace(prepared, ctx=ctx)
        await self.cold_starts.wait(served)  # a model at zero workers: until one is ready, as the gateway
        try:
            route = await self.admission.route(served.name, ticket, lambda: self._routed(prepared, subset))
        except UnroutableError as refusal:
            raise self._refused(served.name, refusal, subset) from None
        quota_headers = {} if use is None else use.headers()
        return Picked(route, address_of(route.worker.url), served.name, ticket, quota_headers)

    def finished(self, picked: Picked, usage: Usage) -> None:
        """The answer ended: the tenant's fair share and token quota are charged what it used."""
        self.admission.finished(picked.model, picked.ticket, usage.completion_tokens)
        self.quotas.spend_soon(picked.ticket.tenant, usage.total_tokens, time.time())

    def _tenant(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant of the request's API key; 401 without a known one when keys are configured."""
        if not self.api_keys.is_enabled:
            return ANONYMOUS
        tenant = self.api_keys.tenant(headers.get("authorization"))
        if tenant is None:
            raise HttpError(
                401, "Incorrect API key provided; send a valid key as 'Authorization: Bearer <key>'"
            )
        return tenant

    async def _routed(self, prepared: Prepared, subset: frozenset[str] | None) -> Route:
        """Route (``UnroutableError`` when no worker may take it now), then write the session pin."""
        route = self._route(prepared, subset)
        try:
            winner = await write_pin(self.state, route)
            if winner is not None:  # another replica pinned the session first: its worker wins
                route.release("none")
                pinned = dataclasses.replace(prepared.ctx, pinned_worker_id=winner)
                route = self._route(dataclasses.replace(prepared, ctx=pinned), subset)
        except BaseException:
            route.release("none")
            raise
        return route

    def _route(self, prepared: Prepared, subset: frozenset[str] | None) -> Route:
        """Decide and apply in one synchronous step, among the workers the subset allows."""
        served, ctx = prepared.served, prepared.ctx
        views = self.registry.all_views(served.name)
        if subset is not None:
            outside = frozenset(view.id for view in views if address_of(view.url) not in subset)
            ctx = dataclasses.replace(ctx, excluded=outside)
        decision = decide_with_headroom(
            self.registry, self.headrooms, served, views, ctx, self.settings.slot_reserve
        )
        return apply_decision(self.registry, self.state, served, decision, priority=ctx.priority)

    def moved(self, picked: Picked, served_address: str) -> None:
        """The data plane served the request on another endpoint of the model (its retry or fallback):
        move the in-flight count there, so the next decision sees where the work is."""
        if served_address == picked.address:
            return
        views = self.registry.all_views(picked.model)
        worker = next((view for view in views if address_of(view.url) == served_address), None)
        if worker is None:
            log.warning(
                "the data plane served a request on an endpoint herd does not know",
                extra={"model": picked.model, "picked": picked.address, "served": served_address},
            )
            return
        picked.route.release("none")
        hold = self.registry.hold(worker.id, priority=picked.ticket.priority)
        picked.route = Route(dataclasses.replace(picked.route.decision, worker=worker), hold, None)
        picked.address = served_address

    def _refused(self, model: str, refusal: UnroutableError, subset: frozenset[str] | None) -> HttpError:
        retry_after = {"Retry-After": str(self.settings.retry_after_seconds)}
        if refusal.reason == "slo_unmet":
            message = f"no worker of model {model!r} is predicted to meet the request's latency targets"
            return HttpError(
                429, f"{message}; retry after {retry_after['Retry-After']}s", headers=retry_after
            )
        if refusal.reason == "at_capacity":
            message = (
                f"every worker of model {model!r} is at capacity; retry after {retry_after['Retry-After']}s"
            )
            return HttpError(429, message, headers=retry_after)
        where = "" if subset is None else f" among the {len(subset)} endpoints of the gateway's subset"
        message = f"model {model!r} has no ready worker{where} right now; retry shortly"
        return HttpError(503, message, headers=retry_after)
