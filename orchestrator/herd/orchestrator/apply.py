"""Applying a routing decision in one synchronous step, and writing its session pin after.

Every edge over ``decide`` (herd's gateway, the endpoint picker) applies a ``Decision`` the same way,
before it awaits anything: ``Registry.hold`` counts the decode worker and the prefill worker in flight
(the prefilling worker's uncached tokens too), and the blocks about to exist on them are expected in
the model's KV index and shared with the other replicas. The session pin is written afterwards; when
another replica claimed the session first, the edge decides again with that replica's worker.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from herd.orchestrator.breaker import Outcome
from herd.orchestrator.registry import Hold, Registry
from herd.orchestrator.routing import Decision, RequestContext, WorkerView, decide
from herd.orchestrator.routing.headroom import Headrooms
from herd.orchestrator.routing.reserve import SlotReserve
from herd.orchestrator.served import ServedModel
from herd.orchestrator.state import State

__all__ = ["Route", "apply_decision", "decide_with_headroom", "write_pin"]


@dataclass(eq=False)
class Route:
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


def decide_with_headroom(
    registry: Registry,
    headrooms: Headrooms,
    served: ServedModel,
    views: Sequence[WorkerView],
    ctx: RequestContext,
    reserve: SlotReserve,
) -> Decision:
    """``decide`` over ``views`` with the workers the idle headroom keeps off background work now, as
    the gateway and the endpoint picker both decide."""
    in_flight = registry.in_flight_by_priority(served.name)
    kept = headrooms.kept(served.name, in_flight, views, ctx.priority, time.monotonic())
    return decide(served, views, ctx, reserve, kept)


def apply_decision(
    registry: Registry, state: State, served: ServedModel, decision: Decision, *, priority: int = 0
) -> Route:
    """Count the decision's workers in flight (at the request's ``priority``) and expect its blocks on
    them; synchronous, so nothing runs between the choice and the counts and the next decision sees them."""
    prefill = decision.prefill
    local_prefill_tokens = decision.num_prefill_tokens if prefill is None else 0
    hold = registry.hold(decision.worker.id, num_prefill_tokens=local_prefill_tokens, priority=priority)
    prefill_hold = (
        None
        if prefill is None
        else registry.hold(prefill.id, num_prefill_tokens=decision.num_prefill_tokens, priority=priority)
    )
    if decision.expected_blocks:
        for worker in (decision.worker, prefill):
            if worker is not None:
                served.kv_index.expect(worker.id, decision.expected_blocks)
                state.share_expected(worker.id, decision.expected_blocks)
    return Route(decision, hold, prefill_hold)


async def write_pin(state: State, route: Route) -> str | None:
    """Write the route's session pin, if it has one; the pinned worker of the replica that claimed the
    session first when that is another worker (the caller then routes again to it), else ``None``."""
    pin = route.decision.pin
    if pin is None:
        return None
    if not pin.is_claim:
        await state.set_pin(pin.key, pin.worker_id, pin.ttl_seconds)
        return None
    winner = await state.claim_pin(pin.key, pin.worker_id, pin.ttl_seconds)
    return None if winner == pin.worker_id else winner
