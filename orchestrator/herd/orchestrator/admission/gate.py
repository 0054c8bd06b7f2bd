"""The gateway's admission step: route now, or wait in the model's fair queue until a worker has room.

``Admission.route`` runs the gateway's routing attempt; when it finds every worker full
(``UnroutableError("at_capacity")``), or requests as urgent as it already wait for that model, the request
waits its turn (``herd.orchestrator.admission.waiting``) and tries again when woken. A request that
routes is charged to its tenant's virtual token counter: its prompt and expected output then, the
difference to its real output when it ends (``finished``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from herd.api.errors import HttpError
from herd.api.openai import EmbeddingRequest, SamplingFields
from herd.orchestrator.admission.targets import slo_target
from herd.orchestrator.admission.tenants import PRIORITY_HEADER, Tenant, effective_priority
from herd.orchestrator.admission.waiting import ModelQueue, QueueRefusalError, QueueSettings, Turn
from herd.orchestrator.routing import RequestContext, UnroutableError
from herd.orchestrator.routing._types import SloMiss

__all__ = ["DEFAULT_EXPECTED_OUTPUT", "Admission", "Ticket", "admitted_context", "ticket_for"]

R = TypeVar("R")

DEFAULT_EXPECTED_OUTPUT = 256
"""The output a request without ``max_tokens`` is charged for until its real output is known."""

_REASONS = {
    "queue_full": "its queue is full",
    "shed": "a more urgent request took its place in the queue",
    "timed_out": "it waited in the queue for the longest time allowed",
}


@dataclass(frozen=True, slots=True)
class Ticket:
    """What admission knows of a request: who sends it, how urgent, and its size in tokens."""

    tenant: Tenant
    priority: int
    num_prompt_tokens: int
    num_expected_output: int

    @property
    def num_charged(self) -> int:
        return self.num_prompt_tokens + self.num_expected_output


def ticket_for(
    tenant: Tenant,
    request: SamplingFields | EmbeddingRequest,
    headers: Mapping[str, str],
    size: int,
    num_prompt_tokens: int,
) -> Ticket:
    """A request's admission ticket; an untokenized prompt counts as ``size / 4`` tokens, and an
    embedding generates none."""
    priority = effective_priority(tenant, request.priority, headers.get(PRIORITY_HEADER))
    if isinstance(request, EmbeddingRequest):
        num_output = 0
    else:
        num_output = (request.output_limit or DEFAULT_EXPECTED_OUTPUT) * request.n
    return Ticket(tenant, priority, num_prompt_tokens or size // 4, num_output)


def admitted_context(
    ctx: RequestContext, ticket: Ticket, headers: Mapping[str, str], slo_miss: SloMiss
) -> RequestContext:
    """``ctx`` as ``decide`` routes the admitted request: at its ticket's priority (so a background
    one leaves the slot reserve to more urgent ones), with the latency targets of its headers (400
    for a bad one; ``slo_miss`` when they name no policy)."""
    return dataclasses.replace(ctx, priority=ticket.priority, slo=slo_target(headers, slo_miss))


class Admission:
    def __init__(self, settings: QueueSettings | None = None, *, retry_after_seconds: int = 1) -> None:
        self.settings = settings or QueueSettings()
        self.retry_after_seconds = retry_after_seconds
        self._queues: dict[str, ModelQueue] = {}

    def queue(self, model: str) -> ModelQueue:
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = ModelQueue(self.settings)
        return queue

    def num_waiting(self, model: str) -> int:
        queue = self._queues.get(model)
        return 0 if queue is None else len(queue.fair)

    def wake(self, model: str) -> None:
        """A worker of ``model`` has room (a request ended, a worker was admitted)."""
        queue = self._queues.get(model)
        if queue is not None:
            queue.wake()

    async def route(self, model: str, ticket: Ticket, attempt: Callable[[], Awaitable[R]]) -> R:
        """``attempt()``'s route, waiting in line while ``model``'s workers are full; 429 when refused."""
        queue = self.queue(model)
        tenant = ticket.tenant
        turn: Turn | None = None
        is_routed = False
        try:
            while True:
                if turn is None and not queue.is_open_to(ticket.priority):
                    turn = await self._wait(queue, None, ticket)
                try:
                    routed = await attempt()
                except UnroutableError as refusal:
                    if refusal.reason != "at_capacity":
                        raise
                    turn = await self._wait(queue, turn, ticket)
                    continue
                queue.charge(tenant.name, ticket.num_charged, tenant.weight)
                is_routed = True
                return routed
        finally:
            if turn is not None:
                had_turn = turn.is_woken
                queue.done(turn)
                if had_turn and not is_routed:  # it failed otherwise: the room it was given is still there
                    queue.wake()

    def finished(self, model: str, ticket: Ticket, num_output_tokens: int) -> None:
        """Correct the tenant's counter by the output the request really produced."""
        queue = self.queue(model)
        queue.charge(ticket.tenant.name, num_output_tokens - ticket.num_expected_output, ticket.tenant.weight)

    async def _wait(self, queue: ModelQueue, turn: Turn | None, ticket: Ticket) -> Turn:
        try:
            return await queue.wait(
                turn, tenant=ticket.tenant.name, priority=ticket.priority, weight=ticket.tenant.weight
            )
        except QueueRefusalError as refusal:
            retry_after = str(self.retry_after_seconds)
            message = (
                f"every worker of this model is at capacity and {_REASONS[refusal.reason]}; "
                f"retry after {retry_after}s"
            )
            raise HttpError(429, message, headers={"Retry-After": retry_after}) from None
