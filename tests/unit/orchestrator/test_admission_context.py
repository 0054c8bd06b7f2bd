"""``admitted_context``: how the gateway and ``herd epp`` both route an admitted request, at its
ticket's priority (the slot reserve's input) and with its headers' latency targets."""

from __future__ import annotations

import pytest

from herd.api.errors import HttpError
from herd.api.openai import ChatCompletionRequest
from herd.orchestrator.admission.gate import admitted_context, ticket_for
from herd.orchestrator.admission.tenants import Tenant
from herd.orchestrator.routing import RequestContext
from herd.orchestrator.routing._types import SloTarget
from herd.orchestrator.routing.reserve import DEFAULT_RESERVE, background_room, may_take_slot

BATCH = 1000


def request(priority: int | None = None) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "priority": priority}
    )


@pytest.mark.parametrize(
    ("tenant_priority", "body_priority", "headers", "priority", "slo"),
    [
        (0, None, {}, 0, None),
        (5, None, {}, 5, None),
        (5, 1, {}, 5, None),  # never more urgent than the tenant's
        (0, BATCH, {}, BATCH, None),
        (0, None, {"x-herd-priority": str(BATCH)}, BATCH, None),
        (0, None, {"x-slo-ttft-ms": "200"}, 0, SloTarget(ttft_seconds=0.2, on_miss="queue")),
        (
            0,
            None,
            {"x-slo-tpot-ms": "50", "x-slo-policy": "refuse"},
            0,
            SloTarget(tpot_seconds=0.05, on_miss="refuse"),
        ),
    ],
    ids=["tenant", "tenant-5", "body-cannot-raise", "body-batch", "header-batch", "ttft", "tpot-refuse"],
)
def test_the_context_carries_the_tickets_priority_and_the_headers_targets(
    tenant_priority: int,
    body_priority: int | None,
    headers: dict[str, str],
    priority: int,
    slo: SloTarget | None,
) -> None:
    tenant = Tenant(name="t", priority=tenant_priority)
    ticket = ticket_for(tenant, request(body_priority), headers, size=100, num_prompt_tokens=10)
    ctx = admitted_context(RequestContext(model="m", headers=headers), ticket, headers, "queue")
    assert (ctx.priority, ctx.slo, ctx.model) == (priority, slo, "m")


@pytest.mark.parametrize(("headers", "may_take"), [({}, True), ({"x-herd-priority": str(BATCH)}, False)])
def test_a_batch_priority_context_leaves_the_reserved_slot(headers: dict[str, str], may_take: bool) -> None:
    """On a worker of 4 slots with 3 batch requests in flight, the last slot is the reserve's."""
    ticket = ticket_for(Tenant(name="t"), request(), headers, size=100, num_prompt_tokens=10)
    ctx = admitted_context(RequestContext(model="m"), ticket, headers, "route")
    assert may_take_slot(3, 3, 4, background_room(ctx.priority, 4, DEFAULT_RESERVE)) is may_take


def test_a_bad_target_header_is_a_400_naming_it() -> None:
    ticket = ticket_for(Tenant(name="t"), request(), {}, size=100, num_prompt_tokens=10)
    with pytest.raises(HttpError) as refused:
        admitted_context(RequestContext(model="m"), ticket, {"x-slo-ttft-ms": "soon"}, "route")
    assert refused.value.status == 400 and "x-slo-ttft-ms" in refused.value.message
