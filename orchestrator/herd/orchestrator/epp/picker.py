"""The endpoint picker's edge over the routing decision: prepare, decide, hold, as herd's gateway does.

``Picker.pick`` prepares a request exactly as the gateway does (``Preparer``: parse, tokenize, hash,
the session pin), leaves out the workers outside the data plane's subset hint, calls ``decide`` and
applies the decision in the same synchronous step (``apply_decision``: the worker counted in flight,
its blocks expected). The returned ``Route`` stays held until the response ends (``Route.release``).
A disaggregated model cannot be served through a gateway that forwards each request to one endpoint,
so the picker refuses it and names herd's own gateway.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from herd.api.errors import HttpError
from herd.orchestrator.apply import Route, apply_decision, write_pin
from herd.orchestrator.cold_start import ColdStarts
from herd.orchestrator.epp.wire import address_of
from herd.orchestrator.prepare import Prepared, Preparer
from herd.orchestrator.registry import Registry
from herd.orchestrator.routing import UnroutableError, decide
from herd.orchestrator.state import State

__all__ = ["Picked", "Picker", "PickerSettings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PickerSettings:
    retry_after_seconds: int = 1
    """``Retry-After`` on a 429 (every worker full) or a 503 (no worker ready)."""
    max_body_bytes: int = 4 * 1024 * 1024


@dataclass(eq=False)
class Picked:
    """A request's route and the endpoint it names to the data plane."""

    route: Route
    address: str
    model: str


class Picker:
    def __init__(
        self, registry: Registry, state: State, preparer: Preparer, settings: PickerSettings | None = None
    ) -> None:
        self.registry = registry
        self.state = state
        self.preparer = preparer
        self.settings = settings or PickerSettings()
        self.cold_starts = ColdStarts(registry)
        registry.on_admitted = self.cold_starts.wake

    async def pick(
        self, path: str, body: bytes, headers: Mapping[str, str], subset: frozenset[str] | None
    ) -> Picked:
        """The endpoint for one request, held; ``HttpError`` (400, 404, 429, 503, ...) when none."""
        prepared = await self.preparer.prepare(path, body, headers)
        served = prepared.served
        if served.config.mode == "disaggregated":
            raise HttpError(
                501,
                f"model {served.name!r} serves disaggregated (prefill and decode pools), which a gateway "
                "that sends each request to one endpoint cannot run; send it through herd's gateway",
                param="model",
            )
        await self.cold_starts.wait(served)  # a model at zero workers: until one is ready, as the gateway
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
        return Picked(route, address_of(route.worker.url), served.name)

    def _route(self, prepared: Prepared, subset: frozenset[str] | None) -> Route:
        """Decide and apply in one synchronous step, among the workers the subset allows."""
        served, ctx = prepared.served, prepared.ctx
        views = self.registry.all_views(served.name)
        if subset is not None:
            outside = frozenset(view.id for view in views if address_of(view.url) not in subset)
            ctx = dataclasses.replace(ctx, excluded=outside)
        try:
            decision = decide(served, views, ctx)
        except UnroutableError as refusal:
            raise self._refused(served.name, refusal, subset) from None
        return apply_decision(self.registry, self.state, served, decision)

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
        hold = self.registry.hold(worker.id)
        picked.route = Route(dataclasses.replace(picked.route.decision, worker=worker), hold, None)
        picked.address = served_address

    def _refused(self, model: str, refusal: UnroutableError, subset: frozenset[str] | None) -> HttpError:
        retry_after = {"Retry-After": str(self.settings.retry_after_seconds)}
        if refusal.reason == "at_capacity":
            message = (
                f"every worker of model {model!r} is at capacity; retry after {retry_after['Retry-After']}s"
            )
            return HttpError(429, message, headers=retry_after)
        where = "" if subset is None else f" among the {len(subset)} endpoints of the gateway's subset"
        message = f"model {model!r} has no ready worker{where} right now; retry shortly"
        return HttpError(503, message, headers=retry_after)
